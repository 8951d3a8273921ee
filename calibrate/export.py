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

from calibrate.outputs import OutputKind, check_replaceable, set_ordinary_mode, temp_prefix
from model_zoo.config import LlamaConfig
from model_zoo.quant.formats import Scheme, export_tensors_linear
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


def checkpoint_bytes(config: LlamaConfig, scheme: Scheme, group_size: int | None = None) -> int:
    """About what write_checkpoint writes (within a few per cent): fp16 embeddings and norms, the linears as the
    scheme stores them (int8 / fp8 codes + a scale per row; int4 + a scale and a zero per group)."""
    linear = config.n_params() - config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    rest = config.n_params() - linear
    per_weight = {Scheme.INT8: 1.0, Scheme.FP8: 1.0, Scheme.AWQ: 0.5 + 2.5 / (group_size or 128)}.get(scheme, 2.0)
    return int(2 * rest + per_weight * linear) + 2**20  # + configs and tokenizer files


def write_checkpoint(outdir: str | os.PathLike, weights: ModelWeights, tokenizer: Any,
                     quantization_config: Mapping[str, Any] | None, fllama_meta: Mapping[str, Any],
                     force: bool = False, shard_bytes: int = SHARD_BYTES) -> Path:
    out = Path(outdir)
    if out.exists() or out.is_symlink():
        check_replaceable(out, OutputKind.CHECKPOINT, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out), suffix=".tmp"))
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
        for path in (tmp, *tmp.rglob("*")):  # a checkpoint is meant to be shared: no private files
            set_ordinary_mode(path)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to `out`; an existing checkpoint is moved aside first and removed after."""
    if not out.exists():
        os.replace(tmp, out)
        return
    aside = out.with_name(temp_prefix(out) + "old.tmp")  # put back by the next run if this one is killed
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside, out)
        raise
    shutil.rmtree(aside)


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
