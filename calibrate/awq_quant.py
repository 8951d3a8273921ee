"""Group-wise 4-bit rounding as the AWQ search sees it: fake quantization (the packer's rule, dequantized),
clipping a group's range, and the search for each group's clipping range.

Weights are quantized per output row and group of G inputs exactly as the AWQ GEMM format stores them
(REFERENCE.md section 2): s = (max - min).clamp(1e-5) / 15, z = clamp(-round(min / s), 0, 15),
q = clamp(round(w / s) + z, 0, 15), w_hat = (q - z) * s.
"""

from __future__ import annotations

import math

import torch

from calibrate.awq_config import QMAX, SCALE_RANGE_MIN, AwqConfig
from model_zoo.errors import ConfigError

ROW_CHUNK = 256  # output rows per step of the clip search (bounds its memory)


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


def clip_weight(w: torch.Tensor, clip_max: torch.Tensor) -> torch.Tensor:
    """Clamp each row's group g of W [N, K] to [-clip_max[n, g], clip_max[n, g]]; G = K / clip_max.shape[1]."""
    n, k = w.shape
    if clip_max.shape[0] != n or k % clip_max.shape[1]:
        raise ConfigError(f"clip max of shape {tuple(clip_max.shape)} does not fit a weight {tuple(w.shape)}")
    c = clip_max.to(w.device, w.dtype).reshape(n, clip_max.shape[1], 1)  # [N, K/G, 1]
    wg = w.reshape(n, clip_max.shape[1], -1)  # [N, K/G, G]
    return torch.maximum(torch.minimum(wg, c), -c).reshape(n, k)


def search_clip(w: torch.Tensor, x: torch.Tensor, cfg: AwqConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] read by x [T, K] -> (clip max [N, K/G], its error [N, K/G], the error unclipped [N, K/G]).

    Error of row n, group g: mean over the sampled tokens of (x_g . (w_hat_g - w_g))^2, computed as
    d^T C_g d with C_g = mean x_g x_g^T: AutoAWQ's per-group output error with far fewer flops, so that
    every search token can take part (AutoAWQ samples 512).
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
