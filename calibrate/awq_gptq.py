"""AWQ int4 weights rounded by GPTQ (calibrate/gptq_round.py) on the grid the AWQ search fixed.

The checkpoint does not change: int4 codes, each group's fp16 step and zero point from its (clipped) range as
round-to-nearest sets them (model_zoo.quant.awq_pack.awq_grid), AWQ's input scales already folded into the
weights. Only which of its group's 16 levels each weight takes changes: columns are rounded largest input energy
first, each error pushed onto the columns not yet rounded, so that the layer's outputs on the calibration text
move less. A weight pushed past its group's range takes the end level (codes clamp to 0..15). The weights aimed at
may be the unclipped ones: the clips set the grids, and what they cut is then compensated like a rounding error
(calibrate.quantize does so; measured better than aiming at the clipped weights, docs/quality.md).
"""

from __future__ import annotations

import torch

from calibrate.gptq_round import GptqConfig, gptq_round
from model_zoo.quant.awq_pack import QMAX, awq_grid, pack_awq
from model_zoo.quant.linear import AwqLinear


@torch.no_grad()
def gptq_awq(w: torch.Tensor, h: torch.Tensor, group_size: int, clip_max: torch.Tensor | None = None,
             cfg: GptqConfig = GptqConfig()) -> AwqLinear:
    """W [N, K] (AWQ-scaled) and H [K, K] of its inputs -> an AwqLinear whose codes minimise ||(W - W_hat) X||
    column by column; steps and zero points as round-to-nearest's, from the range after `clip_max` [N, K/G]."""
    n, k = w.shape
    steps, zeros = awq_grid(w, group_size, clip_max)  # [N, K/G] each
    s = steps.float()  # [N, K/G]

    def on_grid(col: torch.Tensor, j: int) -> torch.Tensor:
        g = j // group_size
        return ((torch.round(col / s[:, g]) + zeros[:, g]).clamp(0, QMAX) - zeros[:, g]) * s[:, g]  # [N]

    w_hat = gptq_round(w.float(), h, on_grid, cfg).view(n, k // group_size, group_size)  # [N, K/G, G]
    # (q - z) * s is exact in fp32 (a 4-bit integer times an fp16 step), so dividing by s gives q - z back exactly
    q = (torch.round(w_hat / s.unsqueeze(2)) + zeros.unsqueeze(2)).reshape(n, k)  # [N, K]
    qweight = pack_awq(q.T.to(torch.uint8).contiguous())  # [K, N/8]
    qzeros = pack_awq(zeros.T.to(torch.uint8).contiguous())  # [K/G, N/8]
    return AwqLinear(qweight, qzeros, steps.T.contiguous(), group_size, dtype=w.dtype)
