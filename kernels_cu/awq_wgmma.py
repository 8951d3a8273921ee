"""AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (awq_wgmma.cu), dequantization fused.

    y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)   (+ residual, or SwiGLU)

on the engine's packed layout (awq_gemv.AwqPacked) with groups of 128. The reference is awq_gemv.awq_linear_ref.

Sixth version (fourteenth session): computed as y^T = w_hat x^T with w_hat as wgmma's register operand,
converted in the registers of the warp that loaded its packed words; shared memory holds only x, brought by TMA
and shared by two blocks (multicast). H200, 2048 tokens, the four LLaMA-2-7B shapes: 637-648 TFLOP/s against
cuBLAS fp16's 621-662 in the same run (the four GEMMs of a layer 1,292 us against 1,298), and dequantize +
cuBLAS 557-650 (awq_wgmma.cu has the steps between). The engine's AWQ prefill runs on it
(awq_gemv.FUSED_PREFILL). The five earlier versions made w_hat in shared memory (same benchmark;
FLLAMA_AWQ_TIMING_NO_DEQUANT skipped the conversion):

    version (2-5 warp-specialized, eighth session)    awq_wgmma   no conversion   dequant + cuBLAS   cuBLAS fp16
    1: every warp copies, converts, issues (7th)       427-446     494-554         555-582            610-660
    2: producer warpgroup copies x too, 4 shared slots 440-460     534-578         558-577            617-661
    3: as 2 with separate x / w_hat rings (5 / 3)      416-429     476-512         558-585            618-663
    4: consumers copy their own x                      446-465     512-569         567-592            624-659
    5: as 4 with two producer warpgroups, 192 channels 371-411     427-501         553-596            621-670

docs/gpu.md steps 8 and 14 have why those fell short and what this one changed.
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
