"""Launcher of awq_batch.cu: the AWQ GEMM for decode batches on the GEMV layout (awq_layout.AwqPacked).

A block is 4 panels of 16 channels (64 channels) and 8 * MT tokens, a warp per panel and token half (8 warps
from 16 tokens), streaming 128-k tiles through a shared-memory ring; K is split over several blocks when the
channel blocks alone would leave SMs idle.
Callers go through awq_gemv.awq_linear / awq_batch_gemm, which check the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu import build, counters, tuning
from kernels_cu.awq_layout import AwqPacked
from kernels_cu.checks import out_or_new
from kernels_cu.gemm_shapes import AWQ_WIDEST_TILE, cdiv, sm_count, token_tile


PANEL = 16
PANELS = 4  # per block: one per warp
CHANNELS = PANEL * PANELS
STAGES = 4  # mirrors awq_batch.cu
TILE_K = 128
COUNTER_POOL = "awq_batch"


def takes(n: int) -> bool:
    """The batch kernel needs whole blocks of 64 channels (every LLaMA linear has them)."""
    return n % CHANNELS == 0


def threads(mt: int) -> int:
    """4 warps, 8 from two token tiles on (awq_batch.cu token_halves)."""
    return 128 * (2 if mt >= 2 else 1)


def min_blocks(mt: int, gpt: int) -> int:
    """Resident blocks per SM the kernel's registers are capped for (awq_batch.cu min_blocks)."""
    return 4 if mt == 1 else 2 if (mt == 4 and gpt > 1) else 3


def stage_bytes(mt: int, gpt: int) -> int:
    """One ring slot (awq_batch.cu's Stage): activations, the 4 panels' weights, their group terms."""
    return mt * 8 * TILE_K * 2 + PANELS * 1024 + PANELS * gpt * 8 * 8


@dataclass(frozen=True)
class BatchLaunch:
    """grid (N / 64, splits, ceil(M / (8 MT))), threads(MT) threads, `smem` bytes of dynamic shared memory."""

    mt: int
    splits: int
    tiles_per_split: int
    smem: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return n // CHANNELS, self.splits, cdiv(m, 8 * self.mt)


def plan(m: int, n: int, tiles: int, gpt: int, sms: int, splits: int | None = None) -> BatchLaunch:
    """K splits (tuning.py's awq_batch_*), as many as fill the SMs; `splits` forces the count. No split is left
    empty."""
    mt = token_tile(m, AWQ_WIDEST_TILE)
    columns = (n // CHANNELS) * cdiv(m, 8 * mt)
    if splits is None:
        t = tuning.current()
        splits = max(1, min(t.awq_batch_blocks_per_sm * sms // columns, t.awq_batch_max_splits,
                            tiles // t.awq_batch_min_tiles_per_split))
    splits = max(1, min(splits, tiles))
    tps = cdiv(tiles, splits)
    return BatchLaunch(mt, cdiv(tiles, tps), tps, STAGES * stage_bytes(mt, gpt))


def launch(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None, out: torch.Tensor | None,
           splits: int | None = None) -> torch.Tensor:
    """x fp16 [M, K] (checked by the caller) -> y fp16 [M, p.out_features]."""
    M = x.shape[0]
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=2)
        if M == 0:
            return y
        lp = plan(M, p.n, p.tiles, p.gpt, sm_count(x.device.index), splits)
        grid = lp.grid(M, p.n)
        partial, counts = counters.split_k_workspace(COUNTER_POOL, x.device, lp.splits, M, p.n, grid[0] * grid[2])
        fn = build.get_function("awq_batch.cu", f"awq_batch_mt{lp.mt}_g{p.gpt}_{p.epilogue(residual)}",
                                "PPPPPPPiiiii")
        fn(grid, (threads(lp.mt),), y, x, p.packed, p.terms, residual, partial, counts, M, p.n, p.k, p.tiles,
           lp.tiles_per_split, shared=lp.smem)
    return y
