"""Zeroed int32 counters for kernels whose last block to finish combines the others' partial results
(threadFenceReduction: attention_fused.cu, awq_batch.cu, awq_wgmma_decode.cu). Each kernel family owns its own
pool; a kernel leaves every counter it used at zero again, so one pool serves every later launch and every CUDA
graph."""

from __future__ import annotations

import torch

MIN_COUNT = 1 << 16  # counters kept per (pool, device); grown (never under capture) when a launch needs more

_POOLS: dict[tuple[str, int], torch.Tensor] = {}  # (pool, device index) -> int32 counters
_RETIRED: list[tuple[str, torch.Tensor]] = []  # outgrown (pool, counters): earlier graphs still point at them


def counters(pool: str, device: torch.device, n: int) -> torch.Tensor:
    """The pool's zeroed int32 counters on `device`, at least n of them. Allocated outside any graph capture:
    a captured launch must point at memory that outlives the capture's private pool."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    have = _POOLS.get((pool, index))
    if have is None or have.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{pool} counters must grow to {n} during graph capture: run the same call once "
                               "before capturing")
        if have is not None:
            _RETIRED.append((pool, have))
        have = _POOLS[(pool, index)] = torch.zeros(max(n, MIN_COUNT), dtype=torch.int32, device=device)  # [n]
    return have


def split_k_workspace(pool: str, device: torch.device, splits: int, m: int, n: int,
                      columns: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A K-split GEMM's workspace (awq_batch.cu, awq_wgmma_decode.cu): fp32 partials [splits, m, n] and the pool's
    counters, one per output column of blocks (the last block of a column to finish sums the partials); with one
    split (None, None), the blocks writing the output themselves."""
    if splits <= 1:
        return None, None
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=device)  # [S, M, N]
    return partial, counters(pool, device, columns)


def pools(pool: str) -> list[torch.Tensor]:
    """Every live tensor of the pool (tests check they are zero between launches)."""
    return [t for (name, _), t in _POOLS.items() if name == pool]


def reset(pool: str | None = None) -> None:
    """Zero a pool's counters (all pools by default): only needed after a launch was aborted mid-way."""
    for name, t in [(name, t) for (name, _), t in _POOLS.items()] + _RETIRED:
        if pool is None or name == pool:
            t.zero_()
