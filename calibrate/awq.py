"""AWQ: activation-aware scale search and weight-clipping search for one LLaMA layer.

Per group of linears sharing an input (calibrate.awq_config.SCALE_GROUPS), a scale s per input channel is
searched (calibrate.awq_scale) and folded: the linears' columns times s, whatever produced the input (a norm,
v_proj's or up_proj's rows) divided by s, which leaves the layer's function as it was. Then the clipping range
of each group of weights of v, o, gate, up and down is searched (calibrate.awq_quant.search_clip). The result
(scales, clips) is a plain artifact: save it (calibrate.awq_results), replay it with `apply_awq`, then pack
the dense weights with round-to-nearest (model_zoo.quant.awq_pack).

This is AutoAWQ's algorithm (duo scaling, the same grids, losses and order: with AutoAWQ's settings, layer 0 of
SmolLM2-135M gets its scales and clips bit for bit) with two departures: the clip search reads every search token
rather than 512, and round-to-nearest (s = 1) is always a scale candidate. AwqConfig can also scale v_proj ->
o_proj under GQA (gqa_o_scaling), which AutoAWQ skips: the query heads of one KV head share the scale of its v_proj
row. layer_input sets what the next layer is searched on (choose: per layer, calibrate.awq_choose).

Cost (SmolLM2-135M layer, 4096 search tokens, fp32 CPU): ~12 s of one core's time, most of it the block
forwards of the qkv and gate_up grids; it scales with search_tokens.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from calibrate.awq_config import CLIP_INPUTS, SCALE_GROUPS, AwqConfig, AwqLayerResult, LayerInput, ScaleGroup
from calibrate.awq_quant import clip_weight, fake_quant_groups, search_clip
from calibrate.awq_scale import Weights, loss_fn, search_scale, tied_columns
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.linear import DenseLinear
from model_zoo.reference import layer_forward
from model_zoo.weights import LINEAR_NAMES, LayerWeights

__all__ = ["AwqConfig", "AwqLayerResult", "LayerInput", "apply_awq", "check_group_size", "fake_quant_groups",
           "fold_scales", "scale_groups", "search_clip", "search_layer", "valid_group_sizes", "working_weights"]


def valid_group_sizes(config: LlamaConfig) -> list[int]:
    """Group sizes dividing every input size of a layer (hidden, attention output, FFN), multiples of 8."""
    g = math.gcd(math.gcd(config.hidden_size, config.q_size), config.ffn_size)
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    return [d for d in divisors if d % 8 == 0] or divisors


def check_group_size(config: LlamaConfig, group_size: int) -> None:
    sizes = {"hidden": config.hidden_size, "attention": config.q_size, "ffn": config.ffn_size}
    if group_size < 1 or any(k % group_size for k in sizes.values()):
        dims = ", ".join(f"{n} {k}" for n, k in sizes.items())
        fits = ", ".join(map(str, valid_group_sizes(config)))
        raise ConfigError(f"AWQ group size {group_size} does not divide every input size of this model "
                          f"({dims}); group sizes that do: {fits}")


def scale_groups(config: LlamaConfig, cfg: AwqConfig) -> tuple[ScaleGroup, ...]:
    o = config.n_heads == config.n_kv_heads or cfg.gqa_o_scaling
    return tuple(g for g in SCALE_GROUPS if g.name != "o" or o)


@torch.no_grad()
def search_layer(layer: LayerWeights, config: LlamaConfig, x: torch.Tensor, cfg: AwqConfig) -> AwqLayerResult:
    """Search AWQ scales and clips for one layer from its input hidden states x [B, S, H]."""
    check_group_size(config, cfg.group_size)
    if x.dim() != 3 or x.shape[2] != config.hidden_size:
        raise ConfigError(f"layer input must be [B, S, {config.hidden_size}], got {tuple(x.shape)}")
    ct = torch.promote_types(layer.attn_norm.dtype, torch.float32)
    n_samples = min(x.shape[0], -(-cfg.search_tokens // x.shape[1]))
    x = x[:n_samples].to(ct)  # [B', S, H]
    ws = working_weights(layer, ct)
    inputs = _capture_inputs(ws, config, x)
    result = AwqLayerResult()
    for group in scale_groups(config, cfg):
        tie = tied_columns(group, config)
        judge = loss_fn(group.name, config, inputs[group.name], ws)
        s, alpha, best, rtn = search_scale(ws, group, inputs[group.name], judge, cfg, tie)
        fold_scales(ws, group, s, config)
        inputs[group.name] = inputs[group.name] / tie.expand(s)  # what the scaled layer now feeds these linears
        result.scales[group.name], result.alphas[group.name] = s, alpha
        result.losses[group.name], result.losses[group.name + ".rtn"] = best, rtn
    if cfg.clip:
        for attr, point in CLIP_INPUTS.items():
            x_in = inputs[point].reshape(-1, inputs[point].shape[-1])  # [T, K]
            clip, err, err_none = search_clip(ws[attr], x_in, cfg)
            result.clips[attr] = clip
            result.losses[f"clip.{attr}"] = float(err.mean())
            result.losses[f"clip.{attr}.none"] = float(err_none.mean())
    return result


def working_weights(layer: LayerWeights, dtype: torch.dtype) -> Weights:
    ws = {a: lin.dense_weight().to(dtype) for a, lin in layer.linears().items()}
    ws["attn_norm"], ws["ffn_norm"] = layer.attn_norm.to(dtype), layer.ffn_norm.to(dtype)
    return ws


def fold_scales(ws: Weights, group: ScaleGroup, s: torch.Tensor, config: LlamaConfig) -> None:
    """Divide the input of `group` by s and multiply its linears' columns by s (same function).

    s has one entry per channel of what produces the input ([kv_size] for o: one per v_proj row).
    """
    prev = ws[group.prev]
    if s.dim() != 1 or s.shape[0] != prev.shape[0]:
        raise ConfigError(f"AWQ scales for {group.name!r} have shape {tuple(s.shape)} but the layer needs "
                          f"[{prev.shape[0]}]" + (" (one per v_proj row)" if group.name == "o" else ""))
    s = s.to(prev.device, prev.dtype)
    ws[group.prev] = prev / s if prev.dim() == 1 else prev / s[:, None]
    sk = tied_columns(group, config).expand(s)  # [K]
    for a in group.linears:
        ws[a] = ws[a] * sk  # [N, K]


@torch.no_grad()
def apply_awq(layer: LayerWeights, result: AwqLayerResult, config: LlamaConfig) -> LayerWeights:
    """Fold the scales into the norms / v_proj / up_proj and the linears, clamp the clipped linears.

    Returns dense weights in the layer's dtype, computing the same function as `layer` up to the
    clipping; round-to-nearest packing of them is the AWQ checkpoint.
    """
    ct = torch.promote_types(layer.attn_norm.dtype, torch.float32)
    ws = working_weights(layer, ct)
    for group in SCALE_GROUPS:  # the search's order, so a replay is bit-identical
        if group.name in result.scales:
            fold_scales(ws, group, result.scales[group.name], config)
    for attr, clip in result.clips.items():
        ws[attr] = clip_weight(ws[attr], clip)
    linears = {a: DenseLinear(ws[a].to(lin.dense_weight().dtype)) for a, lin in layer.linears().items()}
    return replace(layer, attn_norm=ws["attn_norm"].to(layer.attn_norm.dtype),
                   ffn_norm=ws["ffn_norm"].to(layer.ffn_norm.dtype), **linears)


def _capture_inputs(ws: Weights, config: LlamaConfig, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four capture points of the layer with weights ws, each [B, S, C]."""
    B, S, _ = x.shape
    layer = LayerWeights(attn_norm=ws["attn_norm"], ffn_norm=ws["ffn_norm"],
                         **{a: DenseLinear(ws[a]) for a, _ in LINEAR_NAMES})
    seen: dict[str, torch.Tensor] = {}
    positions = torch.arange(S, device=x.device).expand(B, S)  # [B, S]
    layer_forward(layer, config, x, positions, observer=lambda p, a: seen.__setitem__(p, a.reshape(B, S, -1)))
    return seen
