"""Embedding lookup (embedding.cu): rows of an fp16 table gathered by int32 or int64 token ids.
An id outside [0, V) gives a zero row (the kernel cannot raise; the engine validates ids on the host).
`embedding_fold` also writes the first layer's deferred RMSNorm (norm_fold.py) for a folded decode step, in the
form an fp16 / AWQ GEMV takes it or (int8) the one quantize_fold takes."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_multiple, check_tensor, out_or_new
from kernels_cu.norm_fold import FoldOut, check_out

SIGNATURE = "PPPiiPP"  # out, table, ids, V, H, lengths, lens
FOLD_SIGNATURE = "PPPPPPiiPP"  # out, xg, part, table, ids, w, V, H, lengths, lens
FOLD8_SIGNATURE = "PPPPPPPiiPP"  # out, xg, part, mx, table, ids, w, V, H, lengths, lens
THREADS = 128


def embedding_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    V = table.shape[0]
    valid = (ids >= 0) & (ids < V)  # [T]
    rows = table[ids.clamp(0, V - 1).long()]  # [T, H]
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


def embedding(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None,
              step_lens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """table fp16 [V, H], ids int32/int64 [T] on the GPU -> fp16 [T, H]. step_lens (lengths, lens), int32 [T]
    each: also lens = lengths + 1 (a decode step's attention lengths, without a kernel of their own)."""
    V, H, T = _check(table, ids)
    out = out_or_new(out, (T, H), torch.float16, table, "out")
    lengths, lens = _step_lens(step_lens, T)
    if T:
        build.get_function("embedding.cu", f"embedding_{_id_type(ids)}", SIGNATURE)(
            (T,), (_threads(H),), out, table, ids, V, H, lengths, lens)
    return out


def embedding_fold(table: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                   step_lens: tuple[torch.Tensor, torch.Tensor] | None = None,
                   int8: bool = False) -> tuple[torch.Tensor, FoldOut]:
    """The lookup, plus the deferred RMSNorm of its rows with weight w [H]: (h fp16 [T, H], FoldOut); int8: the
    FoldOut of an int8 consumer (sums and maxima per 8 channels, for quantize_fold); step_lens as in `embedding`."""
    V, H, T = _check(table, ids)
    out = out_or_new(out, (T, H), torch.float16, table, "out")
    fold = FoldOut.new(w, T, int8)
    check_out(fold, T, H, int8)
    lengths, lens = _step_lens(step_lens, T)
    entry, signature, parts = ("fold8", FOLD8_SIGNATURE, (fold.part, fold.mx)) if int8 else \
        ("fold", FOLD_SIGNATURE, (fold.part,))
    if T:
        build.get_function("embedding.cu", f"embedding_{entry}_{_id_type(ids)}", signature)(
            (T,), (_threads(H),), out, fold.xg, *parts, table, ids, w, V, H, lengths, lens)
    return out, fold


def _step_lens(step_lens: tuple[torch.Tensor, torch.Tensor] | None,
               T: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The kernel's (lengths, lens) arguments: both null, or both checked int32 [T]."""
    if step_lens is None:
        return None, None
    lengths, lens = step_lens
    check_tensor(lengths, "lengths", torch.int32, (T,), align=4)
    check_tensor(lens, "lens", torch.int32, (T,), align=4)
    return lengths, lens


def _check(table: torch.Tensor, ids: torch.Tensor) -> tuple[int, int, int]:
    if table.dim() != 2 or ids.dim() != 1:
        raise ValueError(f"table must be [V, H] and ids [T], got {tuple(table.shape)} and {tuple(ids.shape)}")
    V, H = table.shape
    check_multiple(H, 8, "hidden size")
    check_tensor(table, "table", torch.float16)
    check_tensor(ids, "ids", (torch.int32, torch.int64), align=ids.element_size())
    return V, H, ids.shape[0]


def _id_type(ids: torch.Tensor) -> str:
    return "i32" if ids.dtype == torch.int32 else "i64"


def _threads(H: int) -> int:
    """A thread per 16 bytes of the row (whole warps), at most THREADS."""
    return min(THREADS, max(32, -(-(H // 8) // 32) * 32))
