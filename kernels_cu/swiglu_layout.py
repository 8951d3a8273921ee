"""The interleaved gate|up layout that lets a decode GEMV apply SwiGLU in its epilogue (fp16_gemv.cu, awq_gemv.cu).

A fused gate|up weight has rows [gate 0..F-1; up 0..F-1]. Interleaved by 8, each 16-row panel holds gate rows
8b..8b+7 and then up rows 8b..8b+7: the mma's rows g and g + 8, so one lane holds a gate sum and its up sum.
Outside the GEMV (cuBLAS beyond 16 rows, references) the product comes out interleaved and silu(gate) * up is
a step of its own: on the GPU one kernel, silu_mul.silu_mul_interleaved (fp16_gemv.fp16_swiglu uses it);
`swiglu_interleaved` here is its torch reference, with the same rounding as silu_mul.cu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HALF = 8  # gate (or up) rows per 16-row panel


def gate_up_order(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Row permutation [n] taking [gate; up] (n = 2F, n % 16 == 0) to the interleaved order."""
    if n % (2 * HALF):
        raise ValueError(f"interleaving gate|up needs 2F % 16 == 0, got {n} rows")
    return torch.arange(n, device=device).reshape(2, n // (2 * HALF), HALF).transpose(0, 1).reshape(-1)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows [2F, ...] -> the interleaved rows (a copy)."""
    return w[gate_up_order(w.shape[0], w.device)].contiguous()


def swiglu_interleaved(y: torch.Tensor) -> torch.Tensor:
    """y [M, 2F] in the interleaved column order -> silu(gate) * up [M, F] (fp16 in, fp16 out): torch's F.silu
    (fp32 math rounded to fp16), then an fp16 multiply. The GPU kernel is silu_mul.silu_mul_interleaved."""
    M = y.shape[0]
    y = y.reshape(M, -1, 2, HALF)  # [M, panels, gate | up, 8]
    return (F.silu(y[:, :, 0]) * y[:, :, 1]).reshape(M, -1)
