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
GEMV_WARPS = GEMV_THREADS // 32
GEMV_STAGES = 2


def gemv_ring_bytes(warps: int) -> int:
    """The main loop's ring of weight lines in dynamic shared memory for a block of `warps` warps (gemm_common.cuh
    gemv_ring_bytes: warps x 2 stages x 16 rows x 4 tiles of 64 bytes)."""
    return warps * GEMV_STAGES * GEMV_ROWS * 4 * 64


# the 8-warp blocks' ring; the int8 XQ entries put their quantized rows before it
GEMV_RING_BYTES = gemv_ring_bytes(GEMV_WARPS)


def gemv_shared(blocks: int, need: int, device_index: int | None = None) -> int:
    """Dynamic shared bytes to launch a GEMV grid of `blocks` blocks whose kernel needs `need`.

    With the ring (~70 KB a block) three blocks fit an SM of 228 KB. Grids of more than one wave at two per SM
    (q|k|v, gate|up) run best so. A grid of at most that one wave (o_proj, down_proj: 256 blocks) then lands
    unevenly, three on some SMs and none on others, so it asks for a third of the SM's shared memory: two blocks
    per SM, every SM busy (H200, M = 1: fp16 down 23.97 -> 21.88 us, o 10.10 -> 9.56; on q|k|v and gate|up the
    same cap cost 1-8%)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    if blocks > 2 * sm_count(index):
        return need
    return max(need, smem_per_sm(index) // 3 // 1024 * 1024)


def gemv_xq_shared(m: int, k: int) -> int:
    """Dynamic shared bytes an int8 XQ GEMV needs: the m quantized rows (128-byte aligned), then the ring."""
    return cdiv(m * k, 128) * 128 + GEMV_RING_BYTES

# --- AWQ (awq_gemm.cu)
AWQ_STRIP = 256  # output columns per warp
AWQ_WARPS = 4
AWQ_TILE_K = 16
AWQ_BLOCKS_PER_SM = 2  # target resident blocks (registers allow 3 at MT=1, 2 at MT=2)

# --- decode attention (attention_fused.cu)
ATTN_CHUNKS = (512, 256, 128, 64)  # chunk sizes tried, largest first (the kernel's CS_MAX is 512)
ATTN_BLOCKS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None = None) -> int:
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def smem_per_sm(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))


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
