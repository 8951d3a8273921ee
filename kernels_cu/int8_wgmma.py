"""W8A8 prefill GEMM on Hopper's warpgroup tensor cores (int8_wgmma.cu), dequant epilogue fused.

    y[m, n] = fp16((float(sum_k q_x[m, k] * qweight[n, k]) * a_scale[m]) * w_scale[n])   (+ residual[m, n])

bit for bit the torch._int_mm + int8_dequant path (int8_gemm.py), which it replaces on sm_90 wherever the
grid has a block per SM (takes): cuBLASLt runs an sm80 int8 kernel on Hopper and leaves the int32 product
in memory for a second kernel. The reference is int8_gemm.int8_gemm_ref.
"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.gemm_shapes import cdiv, sm_count

BM, BN, BK, STAGES = 128, 256, 128, 4  # tokens x channels per block, k bytes per stage: int8_wgmma.cu
THREADS = 256
SMEM_BYTES = STAGES * (BM + BN) * BK + 1024  # stages + the 1024-byte alignment of the swizzled tiles


def takes(q_x: torch.Tensor, n: int) -> bool:
    """Whether int8_gemm should use this kernel: a Hopper GPU, N % 8 == 0, and at least one block per SM. With
    fewer tiles than SMs torch._int_mm's smaller tiles won (H200, 512 tokens: down 11008 -> 4096, 64 blocks,
    73 us against 58; gate|up, 344 blocks, 106 against 137)."""
    if not (q_x.is_cuda and q_x.shape[0] > 16 and n % 8 == 0):
        return False
    dev = q_x.device.index or 0
    return build.has_wgmma(dev) and cdiv(q_x.shape[0], BM) * cdiv(n, BN) >= sm_count(dev)


def launch(y: torch.Tensor, q_x: torch.Tensor, a_scale: torch.Tensor, a_stride: int, qweight: torch.Tensor,
           w_scale: torch.Tensor, residual: torch.Tensor | None) -> None:
    """y fp16 [M, N] = the GEMM; int8_gemm checks the arguments, makes y and a_stride (1: per-token scales, 0:
    one per tensor) and calls this inside `build.on_stream()` with M, N > 0. q_x int8 [M, K], K % 16 == 0;
    N % 8 == 0."""
    M, K = q_x.shape
    N = qweight.shape[0]
    res = "_res" if residual is not None else ""
    fn = build.get_function("int8_wgmma.cu", f"int8_wgmma{res}", "PPPiPPPiii")
    fn((cdiv(M, BM), cdiv(N, BN)), (THREADS,), y, q_x, a_scale, a_stride, qweight, w_scale, residual, M, N, K,
       shared=SMEM_BYTES)
