"""AWQ's scale search for one group of linears sharing an input, and the losses that judge it.

A few input channels with large mean |x| matter most; scaling their weight columns up by s before
round-to-nearest (and the input down by 1/s, folded into whatever produced the input) lowers their relative
rounding error. The candidates are s = x_mean^a / w_mean^(1-a) for a on a grid ("duo scaling", AutoAWQ's
default; w_mean is the column's mean |w| relative to its quantization group's max), each judged by the
output error of the block the linears sit in with their weights fake-quantized.

Under GQA the scale of v_proj row j is shared by o_proj column j of every query head reading that KV head: the
statistics of those columns are averaged, and their weights get the same scale (`TiedColumns`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from calibrate.awq_config import ACT_SCALE_MIN, W_MEAN_EPS, AwqConfig, ScaleGroup
from calibrate.awq_quant import fake_quant_groups
from model_zoo.config import LlamaConfig
from model_zoo.reference import apply_rope, attention, rope_cos_sin

Weights = dict[str, torch.Tensor]  # working copy: norms [H] and linear weights [N, K] by attribute
Loss = Callable[[Weights], float]  # output error of a block with trial weights


@dataclass(frozen=True)
class TiedColumns:
    """Input channels of a group's linears that must share one scale: `copies` adjacent blocks of `block`
    channels each, per scale (o_proj under GQA: the query heads of one KV head, head_dim channels each)."""
    copies: int = 1
    block: int = 1

    def reduce(self, v: torch.Tensor) -> torch.Tensor:
        """A statistic per input channel [K] -> per scale [K / copies]: the mean over the tied channels."""
        return v.view(-1, self.copies, self.block).mean(dim=1).reshape(-1)

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Scales [K / copies] -> per input channel [K]."""
        return s.view(-1, 1, self.block).expand(-1, self.copies, self.block).reshape(-1)


def tied_columns(group: ScaleGroup, config: LlamaConfig) -> TiedColumns:
    if group.name == "o" and config.gqa_ratio > 1:
        return TiedColumns(copies=config.gqa_ratio, block=config.head_dim)
    return TiedColumns()


def awq_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Mean |x| per channel [K] (and with duo scaling the weights' w_mean [K]) -> s [K], normalised so that
    max * min = 1 (AutoAWQ)."""
    s = x_mean.pow(alpha)  # [K]
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + W_MEAN_EPS)
    s = s.clamp(min=ACT_SCALE_MIN)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(ws: Weights, group: ScaleGroup, group_size: int) -> torch.Tensor:
    """Per input channel [K]: the mean over every output row of the group's linears of |w| / max |w| of its
    quantization group (how large a column is where it is rounded)."""
    w = torch.cat([ws[a] for a in group.linears], dim=0)  # [N_all, K]
    wg = w.abs().reshape(w.shape[0], -1, group_size)  # [N_all, K/G, G]
    rel = wg / (wg.amax(dim=2, keepdim=True) + 1e-6)  # AutoAWQ's epsilon
    return rel.reshape(w.shape).mean(dim=0)  # [K]


def search_scale(ws: Weights, group: ScaleGroup, x_in: torch.Tensor, loss_fn: Loss, cfg: AwqConfig,
                 tie: TiedColumns) -> tuple[torch.Tensor, float | None, float, float]:
    """Grid search over alpha -> (s [K / tie.copies], alpha, its loss, the loss of round-to-nearest)."""
    x_mean = tie.reduce(x_in.reshape(-1, x_in.shape[-1]).abs().mean(dim=0))  # [K']
    w_mean = tie.reduce(weight_mean(ws, group, cfg.group_size)) if cfg.duo_scaling else None  # [K']
    trial = dict(ws)
    for a in group.linears:
        trial[a] = fake_quant_groups(ws[a], cfg.group_size, zero_point=cfg.zero_point, scale_dtype=cfg.step_dtype)
    rtn = _finite(loss_fn(trial))
    # s = 1 is always a candidate, so the search never loses to round-to-nearest on its own data; without
    # duo scaling it is alpha 0, with it no alpha (None)
    best = (rtn, None if cfg.duo_scaling else 0.0, torch.ones_like(x_mean))
    for i in range(cfg.n_grid):
        alpha = i / cfg.n_grid
        if i == 0 and not cfg.duo_scaling:
            continue  # s = 1, judged above
        s = awq_scales(x_mean, alpha, w_mean)  # [K']
        sk = tie.expand(s)  # [K]
        for a in group.linears:
            trial[a] = fake_quant_groups(ws[a] * sk, cfg.group_size, zero_point=cfg.zero_point,
                                         scale_dtype=cfg.step_dtype) / sk  # [N, K]
        loss = _finite(loss_fn(trial))
        if loss < best[0]:
            best = (loss, alpha, s)
    return best[2], best[1], best[0], rtn


def _finite(loss: float) -> float:
    return math.inf if math.isnan(loss) else loss


def loss_fn(name: str, config: LlamaConfig, x_in: torch.Tensor, ws: Weights) -> Loss:
    """MSE between the output of the module judging a scale group with trial weights and with ws.

    The module is the whole self-attention for qkv, the MLP (down_proj in full precision) for gate_up,
    the linear itself for o and down (AutoAWQ's choice for each).
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
