"""Launcher of awq_wgmma_decode.cu: the AWQ GEMM for decode batches on Hopper (wgmma), groups of 128 (awq_linear takes
it from tuning.awq_wgmma_decode_min_m to awq_gemv_max_m tokens).

    y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)   (+ residual, or SwiGLU)

on the engine's packed layout (awq_layout.AwqPacked); the reference is awq_gemv.awq_linear_ref. A block is one
warpgroup of 64 channels (a 16-channel panel a warp, w_hat as wgmma's register operand) and BT = 32 or 64 tokens,
plus a warp that copies x into a shared-memory ring; K is split over blocks when the channel blocks alone would
leave SMs idle. Callers go through awq_gemv.awq_linear, which checks the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu import build, counters, tuning
from kernels_cu.awq_layout import AwqPacked
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.gemm_shapes import cdiv, sm_count


CHANNELS = 64  # per block: awq_wgmma_decode.cu BN
THREADS = 160  # a consumer warpgroup and the copy warp
SLOTS = 8  # x stages in the ring (XS)
COUNTER_POOL = "awq_wgmma_decode"


def token_tile(m: int) -> int:
    """Tokens a block computes: wgmma n32 up to 32 rows, n64 above."""
    return 32 if m <= 32 else 64


def smem_bytes(bt: int) -> int:
    """The x ring (SLOTS stages of bt rows x 128 bytes), its mbarriers, the swizzle alignment."""
    return SLOTS * bt * 128 + 16 * SLOTS + 1024


def takes(x: torch.Tensor, p: AwqPacked) -> bool:
    """Whether the kernel runs this op: groups of 128 (one term per tile), whole 64-channel blocks, a Hopper GPU."""
    return x.is_cuda and p.gpt == 1 and p.n % CHANNELS == 0 and build.has_wgmma(x.device.index or 0)


@dataclass(frozen=True)
class DecodeLaunch:
    """grid (N / 64, splits, ceil(M / bt)), THREADS threads, smem_bytes(bt) of dynamic shared memory."""

    bt: int
    splits: int
    tiles_per_split: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return n // CHANNELS, self.splits, cdiv(m, self.bt)


def plan(m: int, n: int, tiles: int, sms: int, splits: int | None = None) -> DecodeLaunch:
    """The token tile and the K splits (tuning.py's awq_wgmma_decode_*); `splits` forces the count. No split is
    left empty."""
    bt = token_tile(m)
    columns = (n // CHANNELS) * cdiv(m, bt)
    if splits is None:
        t = tuning.current()
        splits = max(1, min(t.awq_wgmma_decode_blocks_per_sm * sms // columns, t.awq_wgmma_decode_max_splits,
                            tiles // t.awq_wgmma_decode_min_tiles_per_split))
    splits = max(1, min(splits, tiles))
    tps = cdiv(tiles, splits)
    return DecodeLaunch(bt, cdiv(tiles, tps), tps)


def launch(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None, out: torch.Tensor | None,
           splits: int | None = None) -> torch.Tensor:
    """x fp16 [M, K] (checked by the caller) -> y fp16 [M, p.out_features]; `splits` forces the K splits (tuning)."""
    M = x.shape[0]
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=16)  # 16-byte row stores
        if residual is not None:  # read as 16-byte rows in the epilogue
            check_tensor(residual, "residual", torch.float16, (M, p.n), align=16)
        if M == 0:
            return y
        lp = plan(M, p.n, p.tiles, sm_count(x.device.index), splits)
        grid = lp.grid(M, p.n)
        partial, counts = counters.split_k_workspace(COUNTER_POOL, x.device, lp.splits, M, p.n, grid[0] * grid[2])
        fn = build.get_function("awq_wgmma_decode.cu", f"awq_wgmma_decode_t{lp.bt}_{p.epilogue(residual)}",
                                "PPPPPPPiiiii")
        fn(grid, (THREADS,), y, x, p.packed, p.terms, residual, partial, counts, M, p.n, p.k, p.tiles,
           lp.tiles_per_split, shared=smem_bytes(lp.bt))
    return y
