"""The FP8 E4M3 W8A8 product every fp8 decode kernel computes (fp8_gemm.cu's GEMVs, fp8_wgmma.cu,
fp8_wgmma_decode.cu), as its launchers accept and check it:

    y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])  (+ residual[m, n]),   acc = sum_k x8[m, k] * w8[n, k]

Codes come as float8_e4m3fn or their bytes (uint8); the references sum in float64 (exact) and round once.
"""

from __future__ import annotations

import torch

from kernels_cu.swiglu_layout import swiglu_interleaved

FP8 = torch.float8_e4m3fn
CODES = (FP8, torch.uint8)  # e4m3 codes, as float8_e4m3fn or their bytes


def codes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (float8_e4m3fn, their bytes as uint8, or their exact values as fp16) as float8_e4m3fn (or fp16)."""
    return t.view(FP8) if t.dtype == torch.uint8 else t


def fp8_gemm_ref(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """The contract in float64 (exact sums), the two scales, one rounding to fp16, then the fp16 residual add."""
    a = a_scale.double().reshape(-1).expand(x8.shape[0])  # [M]
    acc = codes(x8).double() @ codes(w8).double().t()  # [M, N]
    y = ((acc * a[:, None]) * w_scale.double()[None, :]).to(torch.float16)  # [M, N]
    return y if residual is None else y + residual


def fp8_swiglu_ref(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp8_gemm_ref's products in the interleaved order, then torch's fp16 SiLU and multiply [M, F]."""
    return swiglu_interleaved(fp8_gemm_ref(x8, a_scale, w8, w_scale))
