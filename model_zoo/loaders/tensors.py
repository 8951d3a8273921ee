"""State-dict checks and conversions every loader applies (HF tensor names)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Mapping

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError, UnsupportedArchitectureError
from model_zoo.weights import LINEAR_NAMES, ModelWeights

# Quantization scales keep their stored dtype (fp16 in AWQ / compressed-tensors checkpoints).
SCALE_SUFFIXES = (".weight_scale", ".scales", ".input_scale")
# Buffers some old checkpoints carry that are not parameters of the model (RoPE comes from the config).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# What a quantized linear may store (int8: weight, weight_scale, input_scale, weight_zero_point; AWQ / GPTQ:
# qweight, qzeros, scales, g_idx); the scheme's factory checks which are there and their shapes.
QUANT_LINEAR_SUFFIXES = (".weight", ".weight_scale", ".input_scale", ".weight_zero_point", ".qweight", ".qzeros",
                         ".scales", ".g_idx")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def meta_tensor(dtype: str, shape: list[int], where: str) -> torch.Tensor:
    """A safetensors header entry (its dtype string and shape) as a meta tensor: the shape and dtype, no data."""
    if dtype not in SAFETENSORS_DTYPES:
        raise CorruptCheckpointError(f"{where} has dtype {dtype}, which fllama does not read")
    return torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype], device="meta")


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def cut_config(config: LlamaConfig, n_layers: int | None) -> LlamaConfig:
    """The config with only the first n_layers (for tests and quick runs); None keeps them all."""
    if n_layers is None or n_layers == config.n_layers:
        return config
    if not 0 < n_layers <= config.n_layers:
        raise ConfigError(f"n_layers must be in 1..{config.n_layers}, got {n_layers}")
    return config.replace(n_layers=n_layers)


def wanted(name: str, n_layers: int | None) -> bool:
    """Whether a stored tensor is kept when loading the first n_layers (None: all, so extras get noticed)."""
    if name.endswith(IGNORED_SUFFIXES):
        return False
    i = layer_index(name)
    return i is None or n_layers is None or i < n_layers


def cast_floats(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # fp8 (one-byte float) tensors are quantized codes, kept as stored like int8 ones
    return {k: v.to(dtype) if v.is_floating_point() and v.element_size() > 1 and not k.endswith(SCALE_SUFFIXES)
            else v for k, v in sd.items()}


def stored_dtype(sd: Mapping[str, torch.Tensor]) -> str:
    """The dtype of the linear layers' weights: 'bfloat16', 'int8' / 'float8_e4m3fn' (W8A8) or 'int32' (int4)."""
    linear = {k: v for k, v in sd.items() if "_proj." in k and k.endswith((".weight", ".qweight"))}
    count: Counter[str] = Counter()
    for v in (linear or sd).values():
        count[str(v.dtype).removeprefix("torch.")] += v.numel()
    return count.most_common(1)[0][0] if count else "unknown"


def check_state_dict(config: LlamaConfig, sd: Mapping[str, torch.Tensor], quantized: bool) -> None:
    """CorruptCheckpointError unless `sd` holds exactly config.n_layers complete layers (and shapes fit)."""
    found = {i for i in map(layer_index, sd) if i is not None}
    expected = set(range(config.n_layers))
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        what = f"lacks layers {_span(missing)}" if missing else f"has extra layers {_span(extra)}"
        raise CorruptCheckpointError(f"the checkpoint {what}; the config says {config.n_layers} layers")
    check_all_used(config, sd, quantized)
    if not quantized:
        ModelWeights.from_state_dict(config, sd)  # checks presence and every shape
        return
    # quantized linears store qweight/qzeros/scales or weight + weight_scale; their factories check shapes
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if config.tie_embeddings else ["lm_head.weight"])
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for _, path in LINEAR_NAMES:
            if not any(k.startswith(p + path + ".") for k in sd):
                raise CorruptCheckpointError(f"checkpoint lacks the tensors of {p + path!r}")
    for name in names:
        if name not in sd:
            raise CorruptCheckpointError(f"checkpoint lacks the tensor {name!r}")


def check_all_used(config: LlamaConfig, sd: Mapping[str, torch.Tensor], quantized: bool) -> None:
    """UnsupportedArchitectureError naming any tensor the model would drop: one LLaMA has no place for, a
    non-zero linear bias, or a tied checkpoint's lm_head.weight that differs from the embedding."""
    known = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    suffixes = QUANT_LINEAR_SUFFIXES if quantized else (".weight",)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        known |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for _, path in LINEAR_NAMES:
            known |= {p + path + s for s in suffixes}
            bias = sd.get(p + path + ".bias")
            if bias is not None and bool((bias != 0).any()):
                raise UnsupportedArchitectureError(f"the checkpoint holds a non-zero bias {p + path}.bias; fllama's "
                                                   "linears have none (refusing rather than dropping it)")
            known.add(p + path + ".bias")  # all zeros: computing without it is exact
    unknown = sorted(set(sd) - known)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnsupportedArchitectureError(f"the checkpoint holds tensors a LLaMA model has no place for: "
                                           f"{', '.join(unknown[:3])}{more} (refusing rather than ignoring them)")
    head, embed = sd.get("lm_head.weight"), sd.get("model.embed_tokens.weight")
    if config.tie_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        raise UnsupportedArchitectureError("tie_word_embeddings is true but the checkpoint's lm_head.weight differs "
                                           "from model.embed_tokens.weight")


def _span(ids: list[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) \
        else ", ".join(map(str, ids))
