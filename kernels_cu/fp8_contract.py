"""The FP8 E4M3 W8A8 product every fp8 decode kernel computes (fp8_gemm.cu's GEMVs, fp8_wgmma.cu,
fp8_wgmma_decode.cu), as its launchers accept and check it:

    y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])  (+ residual[m, n]),   acc = sum_k x8[m, k] * w8[n, k]

Codes come as float8_e4m3fn or their bytes (uint8); the references sum in float64 (exact) and round once.
"""

from __future__ import annotations

import torch

from kernels_cu.checks import check_multiple, check_tensor
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


def check_weight(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[int, int, int]:
    """The weight side of an fp8 linear whose input x is [M, K]: w8 e4m3 [N, K] (16-byte aligned), w_scale fp32 [N],
    residual fp16 [M, N]; returns M, K, N."""
    M, K = x.shape
    if w8.dim() != 2 or w8.shape[1] != K:
        raise ValueError(f"the input has K={K} but w8 is {tuple(w8.shape)}")
    N = w8.shape[0]
    check_multiple(K, 16, "the fp8 GEMM's K")
    check_tensor(w8, "w8", CODES)
    check_tensor(w_scale, "w_scale", torch.float32, (N,), align=16)
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (M, N), align=4)
    return M, K, N


def check_act_scale(a_scale: torch.Tensor, M: int) -> None:
    """a_scale fp32: M per-token scales or one per-tensor scale."""
    if a_scale.numel() not in (M, 1):
        raise ValueError(f"a_scale must hold {M} per-token scales or 1 per-tensor scale, got {a_scale.numel()}")
    check_tensor(a_scale, "a_scale", torch.float32, align=4)
