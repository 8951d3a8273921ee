"""AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (awq_wgmma.cu), dequantization fused.

    y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)   (+ residual, or SwiGLU)

on the engine's packed layout (awq_gemv.AwqPacked) with groups of 128. The reference is awq_gemv.awq_linear_ref.

Not used by the engine yet. H200, 2048 tokens, TFLOP/s per LLaMA-2-7B shape (kernels_cu.microbench --only
prefill; FLLAMA_AWQ_TIMING_NO_DEQUANT skips the conversion, timing only):

    version (2-4 warp-specialized, eighth session)    awq_wgmma   no conversion   dequant + cuBLAS   cuBLAS fp16
    1: every warp copies, converts, issues (7th)       427-446     494-554         555-582            610-660
    2: producer warpgroup copies x too, 4 shared slots 440-460     534-578         558-577            617-661
    3: as 2 with separate x / w_hat rings (5 / 3)      416-429     476-512         558-585            618-663
    4: consumers copy their own x (this one)           446-465     512-569         567-592            624-659
    5: as 4 with two producer warpgroups, 192 channels 371-411     427-501         553-596            621-670
       a block, 512 threads (trial, not kept)

The conversion costs ~18% whatever the number of producer warps (4 vs 5), which points at the conversion work:
each 128-token block converts its weights again, 16 times per weight at 2048 tokens (docs/gpu.md step 8).

"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import out_or_new
from kernels_cu.gemm_shapes import cdiv

BM, BN, BK = 128, 256, 64  # tokens x channels per block, k per stage: awq_wgmma.cu
XS, WS, PS = 4, 3, 3  # slots of the x ring, the w_hat ring and the packed-word ring
THREADS = 384  # a producer warpgroup and two consumer warpgroups
PACKED_BYTES = BN * 32 + BN * 4  # packed lane chunks, group terms
SMEM_BYTES = XS * BM * 128 + WS * BN * 128 + PS * PACKED_BYTES + 16 * WS + 1024  # + mbarriers, alignment


def takes(x: torch.Tensor, p) -> bool:
    """Whether the kernel can run this op: groups of 128 (one term per tile) on a Hopper GPU."""
    return x.is_cuda and p.gpt == 1 and build.has_wgmma(x.device.index or 0)


def launch(x: torch.Tensor, p, residual: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """Arguments as awq_linear (which checks them)."""
    M, K = x.shape
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=4)
        if M == 0:
            return y
        fn = build.get_function("awq_wgmma.cu", f"awq_wgmma_{p.epilogue(residual)}", "PPPPPiiii")
        fn((cdiv(M, BM), cdiv(p.n, BN)), (THREADS,), y, x, p.packed, p.terms, residual, M, p.n, K, p.tiles,
           shared=SMEM_BYTES)
    return y
