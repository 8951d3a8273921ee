"""AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (awq_wgmma.cu), dequantization fused.

    y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)   (+ residual, or SwiGLU)

on the engine's packed layout (awq_layout.AwqPacked) with groups of 128. The reference is awq_gemv.awq_linear_ref.

Computed as y^T = w_hat x^T with w_hat as wgmma's register operand, converted in the registers of the warp that
loaded its packed words, so shared memory holds only x, brought by TMA and shared by two blocks (multicast): the
conversion hides under the tensor cores and the GEMM runs at cuBLAS fp16's rate with no w_hat pass. The engine's
AWQ prefill runs on it where it applies (tuning.awq_fused_prefill).
"""

from __future__ import annotations

import torch

from kernels_cu import build, tensor_map
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.gemm_shapes import cdiv

BN, BT = 128, 256  # channels x tokens per block: awq_wgmma.cu
CLUSTER = 2  # blocks sharing each x stage (TMA multicast)
SLOTS = 5  # x stages in shared memory (FLLAMA_AWQ_WGMMA_SLOTS)
THREADS = 384  # two warpgroups issuing wgmma, one whose first thread issues the x copies
BK = 64  # k per stage: 128 bytes of fp16, one row of the 128-byte swizzle
# x stages of 256 rows x 128 bytes, their mbarriers, the swizzle alignment
SMEM_BYTES = SLOTS * BT * 2 * BK + 16 * SLOTS + 1024


def takes(x: torch.Tensor, p) -> bool:
    """Whether the kernel can run this op: groups of 128 (one term per tile) on a Hopper GPU."""
    return x.is_cuda and p.gpt == 1 and build.has_wgmma(x.device.index or 0)


def launch(x: torch.Tensor, p, residual: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """Arguments as awq_linear (which checks them). x's tensor map is made once per buffer (tensor_map.py; under
    CUDA-graph capture a kernel writes it)."""
    M, K = x.shape
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=16)  # 16-byte row stores
        if residual is not None:
            check_tensor(residual, "residual", torch.float16, (M, p.n), align=16)
        if M == 0:
            return y
        xmap = tensor_map.device_map(x, BK, BT // CLUSTER)  # each block of a pair copies half the rows
        fn = build.get_function("awq_wgmma.cu", f"awq_wgmma_{p.epilogue(residual)}", "PPPPPiiii")
        grid = (cdiv(M, BT), cdiv(cdiv(p.n, BN), CLUSTER) * CLUSTER)  # a block past N computes zeros, stores none
        fn(grid, (THREADS,), y, xmap, p.packed, p.terms, residual, M, p.n, K, p.tiles, shared=SMEM_BYTES,
           cluster=(1, CLUSTER, 1))
    return y
