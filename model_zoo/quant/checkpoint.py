"""A loaded checkpoint -> ModelWeights or a description of it, and the int8 lm_head's rounding as values
(for the CPU reference)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from model_zoo.load import load_model, load_tokenizer, resolve_config
from model_zoo.quant.formats import Scheme, describe_quantization, load_quantized_weights, scheme_of
from model_zoo.quant.int8 import dequantize_weight_int8, quantize_weight_int8
from model_zoo.weights import ModelWeights


def build_weights(loaded: Any, dtype: torch.dtype, device: str = "cpu") -> ModelWeights:
    """ModelWeights for a loaded checkpoint, quantized linears included, on `device` in `dtype`."""
    qcfg = loaded.meta.get("quantization_config")
    if scheme_of(qcfg) == Scheme.FP16:
        weights = ModelWeights.from_state_dict(loaded.config, loaded.state_dict, meta={"scheme": "fp16"})
    else:
        weights = load_quantized_weights(loaded.config, loaded.state_dict, qcfg, dtype)
    return weights.to(device, dtype)


def int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] through the int8 lm_head's codes and scales (model_zoo.quant.int8, one scale per row) and back."""
    return dequantize_weight_int8(*quantize_weight_int8(w), dtype=w.dtype)


def _format_line(qcfg: Any) -> str | None:
    """The stored layout when the scheme alone does not say it: a GPTQ checkpoint (run as AWQ int4), or fp8's
    layout, scale granularity and activations."""
    d = describe_quantization(qcfg)
    if "format" not in d:
        return None
    if d["scheme"] == Scheme.FP8.value:
        return (f"{d['format']} (e4m3, weight scales per {' / '.join(d['weight_scales'])}, activations "
                f"{' / '.join(d['act'])})")
    return f"{d['format']} (group {d['group_size']}, {'sym' if d['sym'] else 'asym'}, desc_act {d['desc_act']})"


def held_bytes(sd: Mapping[str, torch.Tensor]) -> int:
    """The bytes of a state dict loaded in fp16 (codes and scales as stored, other floats in fp16), GPTQ's group
    indices aside (a load drops them; act-order's become a permutation, 4 bytes an input row): the built weights'
    for unquantized checkpoints, within ~1% for quantized ones (int8 scales are held in fp32)."""
    return sum(t.numel() * t.element_size() for name, t in sd.items() if not name.endswith(".g_idx"))


def describe_model(source: str | None, random: bool = False) -> dict:
    """What `source` is: architecture, sizes, scheme and stored bytes, tokenizer, chat template (JSON-ready). A
    checkpoint is described from its headers: what only the tensors' values can show (GPTQ's v1 zero points, its
    group indices) is checked when a command loads it."""
    if random:  # the preset's shapes: nothing to read, and random weights of a 70B model would not fit
        c, tok = resolve_config(source), load_tokenizer(source)
        where, kind, meta, nbytes = str(source), "random", {"dtype": "float16"}, 2 * c.n_params()
    else:
        # the headers only: names, shapes and dtypes, checked as a load checks them; no tensor's data is read
        loaded = load_model(source, dtype=torch.float16, shapes_only=True)
        c, tok, where, kind, meta = loaded.config, loaded.tokenizer, loaded.source, loaded.kind, loaded.meta
        nbytes = held_bytes(loaded.state_dict)
    qcfg = meta.get("quantization_config")
    fl = meta.get("fllama") or {}
    info = {
        "source": where,
        "kind": kind,
        "architecture": "llama",
        "name": c.name,
        "layers": c.n_layers,
        "hidden_size": c.hidden_size,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "ffn_size": c.ffn_size,
        "vocab_size": c.vocab_size,
        "context": c.max_positions,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else c.rope_scaling.describe(),
        "sliding_window": c.sliding_window,
        "tied_embeddings": c.tie_embeddings,
        "parameters": c.n_params(),
        "scheme": scheme_of(qcfg).value,
        "quant_format": _format_line(qcfg),
        "stored_dtype": meta.get("dtype"),
        "weight_bytes": nbytes,
        "quantization_config": qcfg,
        "calibrator": fl.get("calibrator"),
        "group_size": (qcfg or {}).get("group_size"),
        "tokenizer": type(tok).__name__ + (f" ({tok.kind})" if hasattr(tok, "kind") else ""),
        "bos_id": tok.bos_id,
        "eos_ids": sorted(tok.eos_ids),
        "chat_template": tok.chat_template is not None,
    }
    if meta.get("gguf_file_type") is not None:
        info["gguf_file_type"] = meta["gguf_file_type"]
    return info
