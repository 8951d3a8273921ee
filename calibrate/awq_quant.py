"""Group-wise 4-bit rounding as the AWQ search sees it: fake quantization (the packer's rule, dequantized),
clipping a group's range, and the search for each group's clipping range.

Weights are quantized per output row and group of G inputs exactly as the AWQ GEMM format stores them
(REFERENCE.md section 2): s = (max - min).clamp(1e-5) / 15, z = clamp(-round(min / s), 0, 15),
q = clamp(round(w / s) + z, 0, 15), w_hat = (q - z) * s.
"""

from __future__ import annotations

import torch

from calibrate.awq_config import QMAX, SCALE_RANGE_MIN, AwqConfig, ClipObjective
from model_zoo.errors import ConfigError

ROW_CHUNK = 256  # output rows per step of the clip search (bounds its memory)
ROW_PASSES = 8  # sweeps of the row objective's search over the groups; it stops at the first that changes nothing


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
    """W [N, K] read by x [T, K] -> (clip max [N, K/G], each row's output error with it [N], unclipped [N]).

    A row's output error is the mean over the sampled tokens of (x . (w_hat - w))^2 = d^T C d, with d = w_hat - w
    and C = mean x x^T [K, K]. Each group's clip is one of max|w_g| * cfg.shrink_ratios. ClipObjective.GROUP
    (AutoAWQ) picks each group's by its own share d_g^T C_gg d_g; ROW starts there and revisits the groups in
    turn, each taking the candidate that gives the whole row the lowest error given the other groups' choices, so
    it never raises a row's error on the sampled tokens. The Gram matrices make every search token cheap (AutoAWQ
    samples 512).
    """
    n, k = w.shape
    G = cfg.group_size
    step = max(1, x.shape[0] // cfg.clip_tokens)
    xs = x[::step][: cfg.clip_tokens]  # [T', K]
    xg = xs.double().reshape(-1, k // G, G)  # [T', K/G, G]
    group_gram = torch.einsum("tgi,tgj->gij", xg, xg) / xs.shape[0]  # [K/G, G, G]: AutoAWQ's per-group errors
    xc = xs.to(torch.promote_types(xs.dtype, torch.float32))
    gram = (xc.T @ xc).double() / xs.shape[0]  # [K, K]; fp32 products: a tenth of the time of fp64's
    ratios = cfg.shrink_ratios  # ratios[0] == 1.0: no clipping
    clips, errs, errs_none = [], [], []
    for r0 in range(0, n, ROW_CHUNK):
        wc = w[r0:r0 + ROW_CHUNK]  # [n', K]
        max_val = wc.abs().reshape(-1, k // G, G).amax(dim=2)  # [n', K/G]
        cands = torch.stack([max_val * r for r in ratios])  # [R, n', K/G]
        d = torch.stack([(fake_quant_groups(wc, G, c, cfg.zero_point, cfg.step_dtype) - wc).double()
                         for c in cands])  # [R, n', K]
        dg = d.view(len(ratios), -1, k // G, G)  # [R, n', K/G, G]
        group_err = (torch.einsum("rngi,gij->rngj", dg, group_gram) * dg).sum(dim=3)  # [R, n', K/G]
        pick = group_err.argmin(dim=0)  # [n', K/G]; a tie keeps the larger range (AutoAWQ)
        if cfg.clip_objective is ClipObjective.ROW:
            pick = _row_search(d, group_err, pick, gram, G)
        best = dg.gather(0, pick[None, :, :, None].expand(1, -1, -1, G))[0].reshape(-1, k)  # [n', K]
        clips.append(cands.gather(0, pick[None])[0])
        errs.append(((best @ gram) * best).sum(dim=1))
        errs_none.append(((d[0] @ gram) * d[0]).sum(dim=1))
    return torch.cat(clips), torch.cat(errs), torch.cat(errs_none)


def _row_search(d: torch.Tensor, group_err: torch.Tensor, pick: torch.Tensor, gram: torch.Tensor,
                G: int) -> torch.Tensor:
    """Coordinate descent on each row's d^T C d over its groups' candidates: d [R, n, K] each candidate's error,
    group_err [R, n, K/G] its d_g^T C_gg d_g, pick [n, K/G] the start -> the candidate index per group."""
    R, n, k = d.shape
    pick = pick.clone()
    cur = d.view(R, n, k // G, G).gather(0, pick[None, :, :, None].expand(1, -1, -1, G))[0].reshape(n, k)  # [n, K]
    grad = cur @ gram  # [n, K]: C d per row, kept up to date as groups change
    rows = torch.arange(n)
    for _ in range(ROW_PASSES):
        changed = 0
        for g in range(k // G):
            sl = slice(g * G, (g + 1) * G)
            others = grad[:, sl] - cur[:, sl] @ gram[sl, sl]  # [n, G]: C_g,rest d_rest
            score = group_err[:, :, g] + 2 * (d[:, :, sl] * others).sum(dim=2)  # [R, n]: the row's error, less a constant
            new = score.argmin(dim=0)  # [n]
            moved = (score[new, rows] < score[pick[:, g], rows]).nonzero()[:, 0]  # [m]; strictly better: no cycles
            if moved.numel() == 0:
                continue
            new = new[moved]
            step = d[new, moved, sl] - cur[moved, sl]  # [m, G]
            grad[moved] += step @ gram[sl]
            cur[moved, sl] += step
            pick[moved, g] = new
            changed += moved.numel()
        if not changed:
            break
    return pick
