"""W8A8 prefill GEMM on Hopper's warpgroup tensor cores (int8_wgmma.cu), dequant epilogue fused.

    y[m, n] = fp16((float(sum_k q_x[m, k] * qweight[n, k]) * a_scale[m]) * w_scale[n])   (+ residual[m, n])

bit for bit the torch._int_mm + int8_dequant path (int8_gemm.py), which it replaces from MIN_M tokens on
sm_90: cuBLASLt runs an sm80 int8 kernel on Hopper and leaves the int32 product in memory for a second
kernel. The reference is int8_gemm.int8_gemm_ref.
"""

from __future__ import annotations

import functools

import torch

from kernels_cu import build
from kernels_cu.checks import out_or_new
from kernels_cu.gemm_shapes import cdiv

BM, BN, BK, STAGES = 128, 256, 128, 4  # tokens x channels per block, k bytes per stage: int8_wgmma.cu
THREADS = 256
SMEM_BYTES = STAGES * (BM + BN) * BK + 1024  # stages + the 1024-byte alignment of the swizzled tiles
MIN_M = 128  # below, a block's 128-token tile is mostly padding: torch._int_mm's smaller tiles do better


@functools.lru_cache(maxsize=None)
def available(device_index: int) -> bool:
    """wgmma exists on sm_90 (Hopper) only."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def takes(q_x: torch.Tensor, n: int) -> bool:
    """Whether int8_gemm should use this kernel: enough tokens, N % 8 == 0, a Hopper GPU."""
    return q_x.is_cuda and q_x.shape[0] >= MIN_M and n % 8 == 0 and available(q_x.device.index or 0)


def launch(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
           residual: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """Arguments as int8_gemm (which checks them): q_x int8 [M, K], K % 16 == 0; N % 8 == 0."""
    M, K = q_x.shape
    N = qweight.shape[0]
    a_stride = 1 if a_scale.numel() == M else 0
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, q_x, "out", align=8)
        if M == 0 or N == 0:
            return y
        res = "_res" if residual is not None else ""
        fn = build.get_function("int8_wgmma.cu", f"int8_wgmma{res}", "PPPiPPPiii")
        fn((cdiv(M, BM), cdiv(N, BN)), (THREADS,), y, q_x, a_scale, a_stride, qweight, w_scale, residual, M, N, K,
           shared=SMEM_BYTES)
    return y
