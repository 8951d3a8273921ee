"""Launch geometry of the GEMV/GEMM and decode-attention kernels: pure arithmetic, testable without a GPU.

Every choice depends only on shapes and the SM count, so a captured CUDA graph stays valid for every step
that has the same shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# --- int8 / fp16 GEMV (int8_gemm.cu, fp16_gemv.cu): 16 output channels per 256-thread block
GEMV_ROWS = 16
GEMV_THREADS = 256

# --- AWQ (awq_gemm.cu)
AWQ_STRIP = 256  # output columns per warp
AWQ_WARPS = 4
AWQ_TILE_K = 16
AWQ_BLOCKS_PER_SM = 2  # target resident blocks (registers allow 3 at MT=1, 2 at MT=2)

# --- decode attention (attention_decode.cu)
ATTN_CHUNKS = (512, 256, 128, 64)  # chunk sizes tried, largest first (the kernel's CS_MAX is 512)
ATTN_BLOCKS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None = None) -> int:
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


AWQ_WIDEST_TILE = 4  # awq_gemv.cu / awq_batch.cu take up to 32 tokens per block


def token_tile(m: int, widest: int = 2) -> int:
    """MT: 8-token tiles per block of the small-M kernels, the fewest of 1, 2, 4 that cover m tokens, at most
    `widest` (fp16 / int8: 2 = 16 tokens per block; the AWQ kernels: 4)."""
    for mt in (1, 2, 4):
        if mt >= widest or m <= 8 * mt:
            return mt
    return widest


def gemv_grid(m: int, n: int) -> tuple[int, int]:
    mt = token_tile(m)
    return cdiv(n, GEMV_ROWS), cdiv(m, 8 * mt)


@dataclass(frozen=True)
class AwqLaunch:
    mt: int  # 8-token tiles per block
    splits: int  # blocks along K per strip (grid.y); partials [splits, M, N]
    tiles_per_warp: int  # 16-row k tiles per warp

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return cdiv(n, AWQ_STRIP), self.splits, cdiv(m, 8 * self.mt)


def awq_launch(m: int, n: int, k: int, sms: int, splits: int | None = None) -> AwqLaunch:
    """Split K so that about AWQ_BLOCKS_PER_SM blocks per SM stream the weight at once.

    `splits` forces a split count (benchmarks sweep it); it is rounded to what the K tiles allow.
    """
    mt = token_tile(m)
    tiles = k // AWQ_TILE_K
    col_blocks = cdiv(n, AWQ_STRIP) * cdiv(m, 8 * mt)
    if splits is None:
        splits = max(1, round(AWQ_BLOCKS_PER_SM * sms / col_blocks))
    splits = max(1, min(splits, cdiv(tiles, AWQ_WARPS)))
    tiles_per_warp = cdiv(tiles, splits * AWQ_WARPS)
    return AwqLaunch(mt, cdiv(tiles, AWQ_WARPS * tiles_per_warp), tiles_per_warp)


def attn_chunk(max_len: int, batch: int, kv_heads: int, head_groups: int, sms: int) -> int:
    """Positions per decode-attention block: the largest chunk that still gives every SM enough blocks.

    Fixed by the cache shape and batch size, never by the current lengths, so one graph serves all steps.
    """
    rows = batch * kv_heads * head_groups
    for cs in ATTN_CHUNKS:
        if rows * cdiv(max_len, cs) >= ATTN_BLOCKS_PER_SM * sms:
            return cs
    return ATTN_CHUNKS[-1]
