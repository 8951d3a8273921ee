"""Write a checkpoint directory other engines load: safetensors (sharded above 5 GB), config.json with
quantization_config, tokenizer files, generation_config.json and fllama's metadata — into a temporary
directory beside the target, renamed into place at the end so a failure leaves nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from model_zoo.errors import FllamaError
from model_zoo.quant.formats import export_tensors_linear
from model_zoo.weights import LINEAR_NAMES, ModelWeights

FORMAT_VERSION = 1
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
META_FILE = "fllama_meta.json"


def checkpoint_tensors(weights: ModelWeights, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """HF-named tensors: quantized linears in their format, everything else in `dtype`."""
    c = weights.config
    out = {"model.embed_tokens.weight": weights.embed.to(dtype), "model.norm.weight": weights.norm.to(dtype)}
    if not c.tie_embeddings:
        out["lm_head.weight"] = weights.lm_head.to(dtype)
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.attn_norm.to(dtype)
        out[p + "post_attention_layernorm.weight"] = layer.ffn_norm.to(dtype)
        for attr, path in LINEAR_NAMES:
            out.update(export_tensors_linear(p + path, getattr(layer, attr), dtype))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def write_checkpoint(outdir: str | os.PathLike, weights: ModelWeights, tokenizer: Any,
                     quantization_config: Mapping[str, Any] | None, fllama_meta: Mapping[str, Any],
                     force: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    out = Path(outdir)
    if out.exists() and not force:
        raise FllamaError(f"{out} already exists; use --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        tensors = checkpoint_tensors(weights)
        _write_shards(tmp, tensors, shard_bytes)
        config = weights.config.to_hf()
        if quantization_config:
            config["quantization_config"] = dict(quantization_config)
        _write_json(tmp / "config.json", config)
        gen = {"bos_token_id": weights.config.bos_id, "eos_token_id": sorted(tokenizer.eos_ids) or weights.config.eos_id,
               "do_sample": True, "temperature": 0.7, "top_p": 0.95}
        _write_json(tmp / "generation_config.json", gen)
        tokenizer.save(tmp)
        _write_json(tmp / META_FILE, {"format_version": FORMAT_VERSION, **fllama_meta})
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_shards(d: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(d / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
