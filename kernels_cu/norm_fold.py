"""The deferred RMSNorm of decode (norm_fold.cuh): no RMSNorm kernel in a small-batch decode step.

A producer -- the GEMV that adds the residual (o_proj, down_proj: fp16_gemv.cu, awq_gemv.cu) or the embedding
lookup -- writes, besides the residual stream h [M, H]:

    xg   fp16 [M, H]       = fp16(h * w)                  w: the next RMSNorm's weight [H]
    part fp32 [M, H / 16]  = sum of h^2 over each 16 channels

and the consumer -- the GEMV that reads the norm's output (q|k|v, gate|up, lm_head) -- takes xg as its
activations and scales each token's fp32 sums by rstd = 1 / sqrt(sum(part) / H + eps) before rounding:

    y = fp16(rstd * (xg @ W^T))     where LlamaRMSNorm has   y = fp16(fp16(w * fp16(h * rstd)) @ W^T)

For an int8 consumer (int8 decode up to 16 rows) the producer -- an int8 GEMV with its residual -- writes the sums
per 8 channels and also mx fp32 [M, H / 8] = max |xg| per 8 channels, and quantize.quantize_fold quantizes xg by
its row max (the codes of rstd * xg, since rstd > 0 cancels) with rstd in a_scale, for the plain int8 GEMV.

Same operations, one fp16 rounding fewer (h * w instead of h * rstd, then * w): the outputs differ from the
unfolded path by rounding only (tests compare both with the float64 reference). xg holds h * w unnormalized,
so it needs |h * w| < 65504 where LlamaRMSNorm's operands stay below sqrt(H) * |w|: LLaMA-2-7B's largest residual
activations are ~2.6e3 (nothing checks it; EngineConfig(fold_norms=False) is the way back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu.checks import check_tensor

CHANNELS = 16  # channels per partial sum: one GEMV panel
INT8_CHANNELS = 8  # an int8 producer's: the 8 channels of one token in one warp of its epilogue


@dataclass(frozen=True)
class FoldIn:
    """A consumer's deferred norm: its x is the producer's xg; part fp32 [M, K / 16]."""

    part: torch.Tensor
    eps: float


@dataclass(frozen=True)
class FoldOut:
    """What a producer writes for the next norm (weight w [H] fp16): xg fp16 [M, H], part fp32 [M, H / 16]; for an
    int8 consumer (mx not None) part and mx are [M, H / 8]."""

    w: torch.Tensor
    xg: torch.Tensor
    part: torch.Tensor
    mx: torch.Tensor | None = None

    @staticmethod
    def new(w: torch.Tensor, m: int, int8: bool = False) -> "FoldOut":
        H = w.shape[0]
        xg = torch.empty((m, H), dtype=torch.float16, device=w.device)  # [M, H]
        c = INT8_CHANNELS if int8 else CHANNELS
        part = torch.empty((m, H // c), dtype=torch.float32, device=w.device)  # [M, H / c]
        mx = torch.empty((m, H // c), dtype=torch.float32, device=w.device) if int8 else None  # [M, H / 8]
        return FoldOut(w, xg, part, mx)

    @property
    def int8(self) -> bool:
        return self.mx is not None

    def consumer(self, eps: float) -> FoldIn:
        return FoldIn(self.part, eps)


def takes(hidden: int) -> bool:
    """Partial sums per 16-channel GEMV panel, read by the consumers 4 (16 bytes) at a time: H % 64 == 0."""
    return hidden % (4 * CHANNELS) == 0


def out_args(fold: FoldOut | None) -> tuple:
    """The producer's kernel arguments (fold_w, fold_xg, fold_part)."""
    return (None, None, None) if fold is None else (fold.w, fold.xg, fold.part)


def in_args(fold: FoldIn | None) -> tuple:
    """The consumer's kernel arguments (fold_in, eps)."""
    return (None, 0.0) if fold is None else (fold.part, float(fold.eps))


def check_out(fold: FoldOut | None, m: int, n: int, int8: bool = False) -> None:
    """A producer's FoldOut for an output [m, n]: int8 whether the producer is an int8 GEMV (8-channel partials
    and maxima) or not (16-channel partials)."""
    if fold is None:
        return
    if not takes(n):
        raise ValueError(f"a deferred norm needs H % 64 == 0, got {n}")
    if fold.int8 != int8:
        raise ValueError(f"this producer writes the deferred norm of {'an int8' if int8 else 'an fp16 / AWQ'} GEMV, "
                         f"the FoldOut is {'int8' if fold.int8 else 'fp16 / AWQ'}'s")
    c = INT8_CHANNELS if int8 else CHANNELS
    check_tensor(fold.w, "fold.w", torch.float16, (n,), align=2)
    check_tensor(fold.xg, "fold.xg", torch.float16, (m, n), align=2)
    check_tensor(fold.part, "fold.part", torch.float32, (m, n // c), align=4)
    if int8:
        check_tensor(fold.mx, "fold.mx", torch.float32, (m, n // c), align=4)


def check_in(fold: FoldIn | None, m: int, k: int) -> None:
    if fold is None:
        return
    if not takes(k):
        raise ValueError(f"a deferred norm needs K % 64 == 0, got {k}")
    check_tensor(fold.part, "fold.part", torch.float32, (m, k // CHANNELS))  # fold_rstd's float4 loads


def fold_out_ref(h: torch.Tensor, w: torch.Tensor, channels: int = CHANNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """(xg, part) of h fp16 [M, H]: fp16 h * w, and float64 sums of h^2 per `channels` channels."""
    M, H = h.shape
    part = h.double().pow(2).reshape(M, H // channels, channels).sum(-1)  # [M, H / channels]
    return h * w, part


def rstd_ref(part: torch.Tensor, eps: float, channels: int = CHANNELS) -> torch.Tensor:
    """float64 [M]: 1 / sqrt(mean(h^2) + eps) from the partial sums."""
    H = part.shape[1] * channels
    return torch.rsqrt(part.double().sum(-1) / H + eps)
