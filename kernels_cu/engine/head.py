"""Around the layers: the final RMSNorm and the lm_head, in fp16 or as int8 codes with a scale per vocabulary row."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.fp16_gemv import fp16_linear, w8a16_linear
from kernels_cu.norm_fold import FoldOut
from kernels_cu.rmsnorm import rmsnorm
from model_zoo.quant.int8 import quantize_weight_int8

QUANT_ROWS = 4096  # vocabulary rows quantized at a time: fp32 temporaries of a chunk, not of the whole head


def quantize_head(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 lm_head [V, H] -> (codes int8 [V, H], scales fp32 [V]), model_zoo.quant.int8's rule, on its device."""
    with build.on_stream():
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for v0 in range(0, w.shape[0], QUANT_ROWS):
            q[v0:v0 + QUANT_ROWS], s[v0:v0 + QUANT_ROWS] = quantize_weight_int8(w[v0:v0 + QUANT_ROWS])
    return q, s


def head_bytes(vocab: int, hidden: int, int8: bool) -> int:
    """Bytes a step reads of the lm_head: int8 codes and an fp32 scale per row, or fp16."""
    return vocab * (hidden + 4 if int8 else 2 * hidden)


def logits(h: torch.Tensor, norm: torch.Tensor, eps: float, fold: FoldOut | None,
           head: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """h [T, H] -> logits [T, V] fp16 through the final norm (deferred into the head's GEMV when `fold`) and the
    head: an fp16 [V, H] tensor, or (codes, scales)."""
    if fold is not None:
        x, fold_in = fold.xg, fold.consumer(eps)
    else:
        x, fold_in = rmsnorm(h, norm, eps), None  # [T, H]
    if isinstance(head, tuple):
        return w8a16_linear(x, *head, fold_in=fold_in)
    return fp16_linear(x, head, fold_in=fold_in)
