"""Embedding lookup (embedding.cu): rows of an fp16 table gathered by int32 or int64 token ids.
An id outside [0, V) gives a zero row (the kernel cannot raise; the engine validates ids on the host)."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_multiple, check_tensor, out_or_new

SIGNATURE = "PPPii"  # out, table, ids, V, H
THREADS = 128


def embedding_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    V = table.shape[0]
    valid = (ids >= 0) & (ids < V)  # [T]
    rows = table[ids.clamp(0, V - 1).long()]  # [T, H]
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


def embedding(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """table fp16 [V, H], ids int32/int64 [T] on the GPU -> fp16 [T, H]."""
    if table.dim() != 2 or ids.dim() != 1:
        raise ValueError(f"table must be [V, H] and ids [T], got {tuple(table.shape)} and {tuple(ids.shape)}")
    V, H = table.shape
    T = ids.shape[0]
    check_multiple(H, 8, "hidden size")
    check_tensor(table, "table", torch.float16)
    check_tensor(ids, "ids", (torch.int32, torch.int64), align=ids.element_size())
    out = out_or_new(out, (T, H), torch.float16, table, "out")
    if T:
        name = "embedding_i32" if ids.dtype == torch.int32 else "embedding_i64"
        threads = min(THREADS, max(32, -(-(H // 8) // 32) * 32))
        build.get_function("embedding.cu", name, SIGNATURE)((T,), (threads,), out, table, ids, V, H)
    return out
