"""AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (awq_wgmma.cu), dequantization fused.

    y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)   (+ residual, or SwiGLU)

on the engine's packed layout (awq_gemv.AwqPacked) with groups of 128. The reference is awq_gemv.awq_linear_ref.

Not used by the engine yet: on the H200 at 2048 tokens it runs at 427-443 TFLOP/s, against 555-582 for
awq_packed_dequant + cuBLAS and 610-660 for cuBLAS fp16 alone (kernels_cu.microbench --only prefill). Without
the dequantization (FLLAMA_AWQ_TIMING_NO_DEQUANT, wrong results) it reaches 494-554, and a deeper prefetch
(5 slots, 3 ahead) changed nothing: the limit is the pipeline itself, in which every warp both copies and
computes and a barrier per 64-k stage couples the two warpgroups (docs/gpu.md step 7). The next version
should hand the copies and the dequantization to producer warps (mbarrier hand-off, setmaxnreg), as
CUTLASS's warp-specialized kernels do.
"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import out_or_new
from kernels_cu.gemm_shapes import cdiv

BM, BN, BK = 128, 256, 64  # tokens x channels per block, k per stage: awq_wgmma.cu
STAGES, WBUF = 4, 3  # x / packed ring slots, w_hat buffers
THREADS = 256
RING_BYTES = BM * 128 + BN * 32 + BN * 4  # x tile, packed lane chunks, group terms
SMEM_BYTES = STAGES * RING_BYTES + WBUF * BN * 128 + 1024  # + w_hat tiles + 1024-byte alignment


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
        epi = "silu" if p.swiglu else "res" if residual is not None else "plain"
        fn = build.get_function("awq_wgmma.cu", f"awq_wgmma_{epi}", "PPPPPiiii")
        fn((cdiv(M, BM), cdiv(p.n, BN)), (THREADS,), y, x, p.packed, p.terms, residual, M, p.n, K, p.tiles,
           shared=SMEM_BYTES)
    return y
