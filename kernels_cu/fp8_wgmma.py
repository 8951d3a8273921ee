"""FP8 E4M3 W8A8 prefill GEMM on Hopper's warpgroup tensor cores (fp8_wgmma.cu), the scales in the epilogue.

    y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])   (+ residual[m, n]),   acc = fp32 sum of x8[m, k] * w8[n, k]

int8_wgmma.cu's tiles with e4m3 operands (twice the fp16 rate) and two-level accumulation: each 128-k stage is summed
by the tensor cores from zero (their e4m3 accumulator keeps only ~14 bits) and added into fp32 registers, so the sums
are fp32 sums of 128-k chunks. fp8_gemm checks the arguments and chooses it (`takes`); the references are
fp8_gemm.fp8_gemm_ref / fp8_swiglu_ref.
"""

from __future__ import annotations

import torch

from kernels_cu import build, tuning
from kernels_cu.gemm_shapes import cdiv

BM, BN, BK, STAGES = 128, 256, 128, 4  # tokens x channels per block, k codes per stage: fp8_wgmma.cu
THREADS = 256
SMEM_BYTES = STAGES * (BM + BN) * BK + 1024  # stages + the 1024-byte alignment of the swizzled tiles
SIGNATURE = "PPPiPPPiii"  # y, x8, a_scale, a_stride, w8, w_scale, residual, M, N, K


def takes(x8: torch.Tensor, n: int) -> bool:
    """Whether fp8_gemm uses this kernel: a Hopper GPU and more rows than the GEMV takes (tuning.fp8_gemv_max_m);
    N % 16 == 0 (the SwiGLU epilogue's panels; every LLaMA width is)."""
    if not (x8.is_cuda and x8.shape[0] > tuning.current().fp8_gemv_max_m and n % 16 == 0):
        return False
    return build.has_wgmma(x8.device.index or 0)


def launch(y: torch.Tensor, x8: torch.Tensor, a_scale: torch.Tensor, a_stride: int, w8: torch.Tensor,
           w_scale: torch.Tensor, residual: torch.Tensor | None, epilogue: str) -> None:
    """y fp16 [M, N] (epilogue "silu": [M, N / 2]) = the GEMM; fp8_gemm checks the arguments, makes y and calls
    this inside `build.on_stream()` with M, N > 0. epilogue: "plain", "res" (with residual) or "silu"."""
    M, K = x8.shape
    N = w8.shape[0]
    fn = build.get_function("fp8_wgmma.cu", f"fp8_wgmma_{epilogue}", SIGNATURE)
    fn((cdiv(M, BM), cdiv(N, BN)), (THREADS,), y, x8, a_scale, a_stride, w8, w_scale, residual, M, N, K,
       shared=SMEM_BYTES)
