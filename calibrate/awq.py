"""AWQ: activation-aware scale search and weight-clipping search for one LLaMA layer (AutoAWQ's algorithm).

A few input channels with large mean |x| matter most; scaling their weight columns up by s before
round-to-nearest (and the input down by 1/s, folded into whatever produced the input) lowers their
relative rounding error. Per group of linears sharing an input, s = mean|x|^alpha is searched over a
grid of alpha by the output error of the block the linears sit in; then each group's clipping range is
shrunk where that lowers the output error. The result (scales, clips) is a plain artifact: save it,
replay it with `apply_awq`, then pack the dense weights with round-to-nearest (model_zoo.quant.awq_pack).

Cost (SmolLM2-135M layer, 4096 search tokens, 20 alphas, fp32 CPU): ~12 s of one core's time, ~90%
of it the block forwards of the qkv and gate_up grids (~0.75 TFLOP); runtime scales with search_tokens.

Weights are quantized per output row and group of G inputs exactly as the AWQ GEMM format stores them
(REFERENCE.md section 2): s = (max - min).clamp(1e-5) / 15, z = clamp(-round(min / s), 0, 15),
q = clamp(round(w / s) + z, 0, 15), w_hat = (q - z) * s.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError
from model_zoo.linear import DenseLinear
from model_zoo.reference import apply_rope, attention, layer_forward, rope_cos_sin
from model_zoo.weights import LINEAR_NAMES, LayerWeights

QMAX = 15  # 4-bit codes 0..15
SCALE_RANGE_MIN = 1e-5  # a constant group still gets a positive quantization step (AutoAWQ's clamp)
ACT_SCALE_MIN = 1e-4  # channels that never fire keep a finite AWQ scale
ROW_CHUNK = 256  # output rows per step of the clip search (bounds its memory)
FORMAT = "fllama.awq_search"
FORMAT_VERSION = 1
META_KEY = "fllama"


@dataclass(frozen=True)
class AwqConfig:
    group_size: int = 128
    zero_point: bool = True  # asymmetric 0..15 codes; the AWQ GEMM export needs True
    n_grid: int = 20  # alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid}; alpha 0 is plain round-to-nearest
    clip: bool = True  # weight-clipping search
    clip_grid: int = 20  # shrink ratios 1 - i/clip_grid ...
    max_shrink: float = 0.5  # ... for i < max_shrink * clip_grid: 1.0 down to 0.55 (AutoAWQ)
    clip_tokens: int = 512  # tokens (strided over the captured ones) for the clip search, as AutoAWQ
    search_tokens: int = 4096  # the scale search uses the first samples that hold this many tokens

    def __post_init__(self) -> None:
        for name in ("group_size", "n_grid", "clip_grid", "clip_tokens", "search_tokens"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ConfigError(f"AWQ {name} must be a positive integer, got {getattr(self, name)}")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ConfigError(f"AWQ max_shrink must be in [0, 1), got {self.max_shrink}")

    @property
    def shrink_ratios(self) -> list[float]:
        n = max(1, int(self.max_shrink * self.clip_grid))  # 1.0 (no clipping) is always a candidate
        return [1.0 - i / self.clip_grid for i in range(n)]


@dataclass
class AwqLayerResult:
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # "qkv" [H], "o" [q_size] (MHA), "gate_up" [H], "down" [F]
    clips: dict[str, torch.Tensor] = field(default_factory=dict)  # "wv", "wo", ... -> clip max [N, K/G]
    losses: dict[str, float] = field(default_factory=dict)  # "qkv", "qkv.rtn", "clip.wv", "clip.wv.none", ...
    alphas: dict[str, float] = field(default_factory=dict)  # the chosen alpha per scale group


@dataclass(frozen=True)
class ScaleGroup:
    name: str  # the capture point of layer_forward's observer: the shared input
    linears: tuple[str, ...]  # linears reading the input: their columns are multiplied by s
    prev: str  # what produced the input: its weight (a norm) or output rows (a linear) are divided by s


# Architecture as data, in AutoAWQ's order; later groups are searched on the already-scaled weights.
SCALE_GROUPS: tuple[ScaleGroup, ...] = (
    ScaleGroup("qkv", ("wq", "wk", "wv"), "attn_norm"),
    ScaleGroup("o", ("wo",), "wv"),  # only MHA: with GQA a v row feeds several o columns
    ScaleGroup("gate_up", ("w_gate", "w_up"), "ffn_norm"),
    ScaleGroup("down", ("w_down",), "w_up"),  # silu(gate) * (up / s) = a / s
)
# Clipped linears and the capture point that feeds each. q and k are not clipped: AutoAWQ skips them
# because the attention scores are too sensitive to their error.
CLIP_INPUTS: dict[str, str] = {"wv": "qkv", "wo": "o", "w_gate": "gate_up", "w_up": "gate_up", "w_down": "down"}

Weights = dict[str, torch.Tensor]  # working copy: norms [H] and linear weights [N, K] by attribute
Loss = Callable[[Weights], float]  # output error of a block with trial weights


def fake_quant_groups(w: torch.Tensor, group_size: int, clip_max: torch.Tensor | None = None,
                      zero_point: bool = True, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W [N, K] -> W_hat [N, K]: 4-bit round-to-nearest per row and group of G inputs, dequantized.

    clip_max [N, K/G] clamps each group to [-clip_max, clip_max] first. scale_dtype (fp16, as the
    checkpoint stores it) rounds the step before the codes are chosen, as model_zoo.quant.awq_pack does.
    """
    if w.dim() != 2:
        raise ConfigError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if group_size < 1 or k % group_size:
        raise ConfigError(f"group size {group_size} does not divide the input size {k}")
    ct = torch.promote_types(w.dtype, torch.float32)
    wg = w.to(ct).reshape(n, k // group_size, group_size)  # [N, K/G, G]
    if clip_max is not None:
        c = clip_max.to(ct).reshape(n, k // group_size, 1)  # [N, K/G, 1]
        wg = torch.maximum(torch.minimum(wg, c), -c)
    if zero_point:
        w_max, w_min = wg.amax(dim=2, keepdim=True), wg.amin(dim=2, keepdim=True)  # [N, K/G, 1]
        step = (w_max - w_min).clamp(min=SCALE_RANGE_MIN) / QMAX
        step = step if scale_dtype is None else step.to(scale_dtype).to(ct)
        zero = (-torch.round(w_min / step)).clamp(0, QMAX)
        q = (torch.round(wg / step) + zero).clamp(0, QMAX)  # [N, K/G, G]
    else:  # symmetric codes -8..7 (AutoAWQ's zero_point=False)
        step = wg.abs().amax(dim=2, keepdim=True).clamp(min=SCALE_RANGE_MIN) / 7
        step = step if scale_dtype is None else step.to(scale_dtype).to(ct)
        zero = torch.zeros_like(step)
        q = torch.round(wg / step).clamp(-8, 7)
    return ((q - zero) * step).reshape(n, k).to(w.dtype)  # [N, K]


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


def scale_groups(config: LlamaConfig) -> tuple[ScaleGroup, ...]:
    mha = config.n_heads == config.n_kv_heads
    return tuple(g for g in SCALE_GROUPS if g.name != "o" or mha)


def awq_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean |x| per channel [K] -> s [K] = x_mean^alpha, normalised so that max * min = 1 (AutoAWQ)."""
    s = x_mean.pow(alpha).clamp(min=ACT_SCALE_MIN)  # [K]
    return s / (s.max() * s.min()).sqrt()


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
    for group in scale_groups(config):
        loss_fn = _loss_fn(group.name, config, inputs[group.name], ws)
        s, alpha, best, rtn = _search_scale(ws, group, inputs[group.name], loss_fn, cfg)
        fold_scales(ws, group, s)
        inputs[group.name] = inputs[group.name] / s  # what the scaled layer now feeds these linears
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


def _search_scale(ws: Weights, group: ScaleGroup, x_in: torch.Tensor, loss_fn: Loss,
                  cfg: AwqConfig) -> tuple[torch.Tensor, float, float, float]:
    """Grid search over alpha -> (s [K], alpha, its loss, the loss at alpha 0 = round-to-nearest)."""
    x_mean = x_in.reshape(-1, x_in.shape[-1]).abs().mean(dim=0)  # [K]
    best = (math.inf, 0.0, torch.ones_like(x_mean))
    rtn = math.inf
    for i in range(cfg.n_grid):
        alpha = i / cfg.n_grid
        s = awq_scales(x_mean, alpha)  # [K]
        trial = dict(ws)
        for a in group.linears:
            trial[a] = fake_quant_groups(ws[a] * s, cfg.group_size, zero_point=cfg.zero_point) / s  # [N, K]
        loss = loss_fn(trial)
        loss = math.inf if math.isnan(loss) else loss
        rtn = loss if i == 0 else rtn
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[2], best[1], best[0], rtn


def search_clip(w: torch.Tensor, x: torch.Tensor, cfg: AwqConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] read by x [T, K] -> (clip max [N, K/G], its error [N, K/G], the error unclipped [N, K/G]).

    Error of row n, group g: mean over sampled tokens of (x_g . (w_hat_g - w_g))^2, computed as
    d^T C_g d with C_g = mean x_g x_g^T (exactly AutoAWQ's per-group output error, far fewer flops).
    """
    n, k = w.shape
    G = cfg.group_size
    step = max(1, x.shape[0] // cfg.clip_tokens)
    xs = x[::step][: cfg.clip_tokens].double().reshape(-1, k // G, G)  # [T', K/G, G]
    gram = torch.einsum("tgi,tgj->gij", xs, xs) / xs.shape[0]  # [K/G, G, G]
    clips, errs, errs_none = [], [], []
    for r0 in range(0, n, ROW_CHUNK):
        wc = w[r0:r0 + ROW_CHUNK]  # [n', K]
        max_val = wc.abs().reshape(-1, k // G, G).amax(dim=2)  # [n', K/G]
        best_err = torch.full_like(max_val, math.inf, dtype=torch.float64)
        best_clip = max_val.clone()
        for r in cfg.shrink_ratios:
            c = max_val * r  # [n', K/G]
            d = (fake_quant_groups(wc, G, c, cfg.zero_point) - wc).double().reshape(-1, k // G, G)  # [n', K/G, G]
            err = (torch.einsum("ngi,gij->ngj", d, gram) * d).sum(dim=2)  # [n', K/G]
            if r == 1.0:
                errs_none.append(err)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_clip = torch.where(better, c, best_clip)
        clips.append(best_clip)
        errs.append(best_err)
    return torch.cat(clips), torch.cat(errs), torch.cat(errs_none)


def working_weights(layer: LayerWeights, dtype: torch.dtype) -> Weights:
    ws = {a: lin.dense_weight().to(dtype) for a, lin in layer.linears().items()}
    ws["attn_norm"], ws["ffn_norm"] = layer.attn_norm.to(dtype), layer.ffn_norm.to(dtype)
    return ws


def fold_scales(ws: Weights, group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the input of `group` by s and multiply its linears' columns by s (same function)."""
    prev = ws[group.prev]
    want = [prev.shape[0]] + [ws[a].shape[1] for a in group.linears]
    if s.dim() != 1 or any(m != s.shape[0] for m in want):
        raise ConfigError(f"AWQ scales for {group.name!r} have shape {tuple(s.shape)} but the layer needs [{want[0]}]"
                          + (" (o scales exist only for MHA)" if group.name == "o" else ""))
    s = s.to(prev.device, prev.dtype)
    ws[group.prev] = prev / s if prev.dim() == 1 else prev / s[:, None]
    for a in group.linears:
        ws[a] = ws[a] * s  # [N, K]


def clip_weight(w: torch.Tensor, clip_max: torch.Tensor) -> torch.Tensor:
    """Clamp each row's group g of W [N, K] to [-clip_max[n, g], clip_max[n, g]]; G = K / clip_max.shape[1]."""
    n, k = w.shape
    if clip_max.shape[0] != n or k % clip_max.shape[1]:
        raise ConfigError(f"clip max of shape {tuple(clip_max.shape)} does not fit a weight {tuple(w.shape)}")
    c = clip_max.to(w.device, w.dtype).reshape(n, clip_max.shape[1], 1)  # [N, K/G, 1]
    wg = w.reshape(n, clip_max.shape[1], -1)  # [N, K/G, G]
    return torch.maximum(torch.minimum(wg, c), -c).reshape(n, k)


@torch.no_grad()
def apply_awq(layer: LayerWeights, result: AwqLayerResult) -> LayerWeights:
    """Fold the scales into the norms / v_proj / up_proj and the linears, clamp the clipped linears.

    Returns dense weights in the layer's dtype, computing the same function as `layer` up to the
    clipping; round-to-nearest packing of them is the AWQ checkpoint.
    """
    ct = torch.promote_types(layer.attn_norm.dtype, torch.float32)
    ws = working_weights(layer, ct)
    for group in SCALE_GROUPS:  # the search's order, so a replay is bit-identical
        if group.name in result.scales:
            fold_scales(ws, group, result.scales[group.name])
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


def _loss_fn(name: str, config: LlamaConfig, x_in: torch.Tensor, ws: Weights) -> Loss:
    """MSE between the output of the module judging a scale group with weights w and with ws.

    The module is the whole self-attention for qkv, the MLP (down_proj in full precision) for gate_up,
    the linear itself for o and down.
    """
    if name in ("o", "down"):
        # mean over tokens and outputs of (x (W' - W)^T)^2 = sum_n d_n^T (X^T X) d_n / (T N): one Gram
        # matrix instead of a [T, N] product per alpha (T = 4096 tokens > K)
        attr = {"o": "wo", "down": "w_down"}[name]
        xf = x_in.reshape(-1, x_in.shape[-1])  # [T, K]
        gram = xf.T @ xf  # [K, K]
        return partial(_gram_loss, attr=attr, w0=ws[attr], gram=gram, count=xf.shape[0] * ws[attr].shape[0])
    if name == "qkv":
        B, S, _ = x_in.shape
        positions = torch.arange(S, device=x_in.device).expand(B, S)  # [B, S]
        cos, sin = rope_cos_sin(config, positions, x_in.dtype)  # [B, S, d]
        block = partial(_attention_block, c=config, h=x_in, positions=positions, cos=cos, sin=sin)
    else:
        block = partial(_mlp_block, h=x_in)
    ref = block(ws)  # [B, S, H] with full-precision weights
    return lambda w: float((block(w) - ref).pow(2).mean())


def _gram_loss(w: Weights, attr: str, w0: torch.Tensor, gram: torch.Tensor, count: int) -> float:
    d = w[attr] - w0  # [N, K]
    return float(((d @ gram) * d).sum() / count)


def _mlp_block(w: Weights, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP from the normed input h [B, S, H] to down_proj's output [B, S, H]."""
    return F.linear(F.silu(F.linear(h, w["w_gate"])) * F.linear(h, w["w_up"]), w["w_down"])


def _attention_block(w: Weights, c: LlamaConfig, h: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Self-attention from the normed input h [B, S, H] to o_proj's output [B, S, H]."""
    B, S, _ = h.shape
    q = F.linear(h, w["wq"]).view(B, S, c.n_heads, c.head_dim).transpose(1, 2)  # [B, nh, S, d]
    k = F.linear(h, w["wk"]).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
    v = F.linear(h, w["wv"]).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = attention(q, k, v, positions, c.gqa_ratio).transpose(1, 2).reshape(B, S, c.q_size)  # [B, S, nh*d]
    return F.linear(o, w["wo"])  # [B, S, H]


def save_awq_results(path: str | Path, layers: Sequence[AwqLayerResult], cfg: AwqConfig,
                     meta: dict[str, Any] | None = None) -> None:
    """One safetensors file: layers.{i}.scales.{group} and layers.{i}.clips.{attr}; losses, alphas and
    the AwqConfig in the JSON metadata. Written to a temporary file and renamed."""
    from safetensors.torch import save_file

    tensors = {}
    for i, r in enumerate(layers):
        for kind, d in (("scales", r.scales), ("clips", r.clips)):
            tensors.update({f"layers.{i}.{kind}.{n}": t.detach().cpu().float().contiguous() for n, t in d.items()})
    info = {"format": FORMAT, "version": FORMAT_VERSION, "awq": asdict(cfg), "n_layers": len(layers),
            "layers": [{"losses": r.losses, "alphas": r.alphas} for r in layers], **(meta or {})}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={META_KEY: json.dumps(info)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class AwqResults:
    layers: list[AwqLayerResult]
    config: AwqConfig
    meta: dict[str, Any]  # everything else save_awq_results was given (model identity, data provenance)


def load_awq_results(path: str | Path) -> AwqResults:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        info = json.loads(raw) if raw else {}
    except (OSError, ValueError, SafetensorError) as e:
        raise CorruptCheckpointError(f"cannot read AWQ search results {path}: {e}") from None
    if info.get("format") != FORMAT or info.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path} is not an fllama AWQ search file (format {FORMAT} v{FORMAT_VERSION})")
    layers = [AwqLayerResult(losses=dict(d["losses"]), alphas=dict(d["alphas"])) for d in info["layers"]]
    for key, t in tensors.items():
        parts = key.split(".")
        if len(parts) != 4 or parts[0] != "layers" or parts[2] not in ("scales", "clips") \
                or not parts[1].isdigit() or int(parts[1]) >= len(layers):
            raise CorruptCheckpointError(f"{path}: unexpected tensor {key!r}")
        getattr(layers[int(parts[1])], parts[2])[parts[3]] = t
    meta = {k: v for k, v in info.items() if k not in ("format", "version", "awq", "n_layers", "layers")}
    return AwqResults(layers=layers, config=AwqConfig(**info["awq"]), meta=meta)
