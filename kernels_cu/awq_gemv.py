"""AWQ int4 linears on the engine's GEMV layout (awq_layout.py): which kernel runs a product of M rows.

M <= awq_gemv_max_m (tuning.py): awq_gemv.cu (y = sum_groups s * sum_k (q - z) x, fp32), or from awq_batch_min_m
tokens the awq_batch.cu GEMM (4 panels per block sharing the activations through shared memory), from
awq_wgmma_decode_min_m on Hopper with groups of 128 awq_wgmma_decode.cu (the same on wgmma). Larger M on Hopper with
groups of 128: awq_wgmma.cu, the fused GEMM; otherwise w_hat [N, K] = fp16((q - z) * s) from awq_packed_dequant,
then cuBLAS. A `swiglu` gate|up op writes silu(gate) * up directly (one kernel instead of two).
"""

from __future__ import annotations

import torch

from kernels_cu import awq_batch, awq_wgmma, awq_wgmma_decode, build, norm_fold, tuning
from kernels_cu.awq_layout import (PANEL, TILE_K, AwqPacked, gemv_takes, pack_for_gemv,  # noqa: F401 (re-exported)
                                   unpack_from_gemv)
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.fp16_gemv import fp16_linear, fp16_swiglu
from kernels_cu.gemm_shapes import AWQ_WIDEST_TILE, cdiv, sm_count, token_tile
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.swiglu_layout import swiglu_interleaved

THREADS = 128
# y, x, packed, terms, residual, M, N, K, tiles, fold_w, fold_xg, fold_part, fold_in, eps, res_early
SIGNATURE = "PPPPPiiiiPPPPfi"
GEMV_TILES_PER_STEP = 2  # U of awq_gemv.cu's one-row-tile entries with groups of 128: a warp's tiles a step


def awq_linear(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
               fold_out: FoldOut | None = None, residual_settled: bool = False) -> torch.Tensor:
    """x fp16 [M, K] -> y fp16 [M, out_features]: the GEMV kernel up to awq_gemv_max_m rows (the batch GEMM from
    awq_batch_min_m where N % 64 == 0 and the work is large enough, its wgmma form from awq_wgmma_decode_min_m on
    Hopper with groups of 128 for wide outputs or more work: tuning.py), else
    the fused GEMM (awq_wgmma.py) where it runs, or w_hat + cuBLAS.
    fold_in / fold_out: the deferred RMSNorm (norm_fold.py), on the GEMV path only (`folds`).
    residual_settled: the residual's writer is at least two launches back on this stream, so it had completed
    before the launch just ahead passed its PDL wait (a layer's residual stream): the GEMV reads it before its
    own wait (common.cuh's rule: a kernel overlaps only the one before it). Not for a residual the previous
    kernel wrote."""
    M = _check(x, p, residual)
    t = tuning.current()
    if fold_in is not None or fold_out is not None:
        if not folds(p, M):
            raise ValueError(f"the deferred RMSNorm runs on the AWQ GEMV only (M < {t.awq_batch_min_m}; with groups of "
                             f"32 k, M <= 8), got M = {M}, groups of {p.gs}")
        return _gemv(x, p, residual, out, fold_in, fold_out, residual_settled)
    work = M * p.k * p.n
    wide = p.n >= t.awq_wgmma_decode_min_n or work >= t.awq_wgmma_decode_min_work
    if t.awq_wgmma_decode_min_m <= M <= t.awq_gemv_max_m and wide and awq_wgmma_decode.takes(x, p):
        return awq_wgmma_decode.launch(x, p, residual, out)
    if t.awq_batch_min_m <= M <= t.awq_gemv_max_m and work >= t.awq_batch_min_work and awq_batch.takes(p.n):
        return awq_batch.launch(x, p, residual, out)
    if M <= t.awq_gemv_max_m:
        return _gemv(x, p, residual, out, residual_settled=residual_settled)
    if t.awq_fused_prefill and awq_wgmma.takes(x, p):
        return awq_wgmma.launch(x, p, residual, out)
    # Elsewhere: w_hat, then fp16's cuBLAS path (residual in cuBLAS's epilogue, in place when out is the
    # residual; SwiGLU of the interleaved product in one kernel).
    with build.on_stream():
        w_hat = awq_packed_dequantize(p)  # [N, K]
        if p.swiglu:
            return fp16_swiglu(x, w_hat, out)  # [M, N/2]
        return fp16_linear(x, w_hat, residual, out)  # [M, N]


def awq_gemv(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
             fold_out: FoldOut | None = None, residual_settled: bool = False) -> torch.Tensor:
    """The GEMV kernel for any M (it re-reads the weight once per 32 rows: meant for M <= 64); residual_settled as
    awq_linear's."""
    _check(x, p, residual)
    return _gemv(x, p, residual, out, fold_in, fold_out, residual_settled)


def folds(p: AwqPacked, m: int) -> bool:
    """Whether awq_linear of m rows takes the deferred RMSNorm: on the GEMV, in the variants that compile it."""
    return m < tuning.current().awq_batch_min_m and _fold_compiled(token_tile(m, AWQ_WIDEST_TILE), p.gpt)


def _fold_compiled(mt: int, gpt: int) -> bool:
    """awq_gemv.cu's FOLD: the deferred norm where the registers allow it (MT * GPT <= 4)."""
    return mt * gpt <= 4


def awq_batch_gemm(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """The batch GEMM (awq_batch.cu) for any M; `splits` forces its K split count (tuning)."""
    _check(x, p, residual)
    if not awq_batch.takes(p.n):
        raise ValueError(f"the AWQ batch GEMM needs N % {awq_batch.CHANNELS} == 0, got N = {p.n}")
    return awq_batch.launch(x, p, residual, out, splits)


def _gemv(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None, out: torch.Tensor | None,
          fold_in: FoldIn | None = None, fold_out: FoldOut | None = None,
          residual_settled: bool = False) -> torch.Tensor:
    M = x.shape[0]
    if fold_out is not None and residual is None:
        raise ValueError("a deferred-norm producer is the GEMV that adds the residual")
    norm_fold.check_out(fold_out, M, p.n)
    norm_fold.check_in(fold_in, M, p.k)
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=2)
        if M == 0:
            return y
        mt = token_tile(M, AWQ_WIDEST_TILE)
        if not _fold_compiled(mt, p.gpt) and (fold_in is not None or fold_out is not None):
            raise ValueError(f"the AWQ GEMV variant for {M} rows and groups of {p.gs} k takes no deferred RMSNorm")
        name = f"awq_gemv_mt{mt}_g{p.gpt}_{p.epilogue(residual)}"
        warps = gemv_warps(p.n // PANEL, sm_count(x.device.index), M, p.tiles) if mt == 1 and p.gpt == 1 else 4
        fn = build.get_function("awq_gemv.cu", name + ("" if warps == 4 else f"_w{warps}"), SIGNATURE)
        fn(gemv_grid(M, p.n), (32 * warps,), y, x, p.packed, p.terms, residual, M, p.n, p.k,
           p.tiles, *norm_fold.out_args(fold_out), *norm_fold.in_args(fold_in), int(residual_settled))
    return y


def gemv_warps(panels: int, sms: int, rows: int = 1, tiles: int = 0) -> int:
    """Warps per panel (16, 8, 2, 1 or 4) of a GEMV of `rows` <= 8 rows (groups of 128) over `panels` 16-channel
    panels of `tiles` 128-k tiles on a GPU of `sms` SMs: 16 for one row where the grid is at most a block a SM and
    an 8-warp block would take more than one step (awq_sixteen_warp_one_block), else the widest block whose grid is
    one wave of 16 warps a SM, 2-warp blocks only where that wave holds awq_two_warp_min_warps warps a SM, 1-warp
    blocks only from awq_one_warp_min_rows rows, 4-warp blocks where their grid is one wave (awq_four_warp_one_wave),
    then awq_wide_waves (tuning.py)."""
    t = tuning.current()
    if t.awq_sixteen_warp_one_block and rows == 1 and panels <= sms and tiles > 8 * GEMV_TILES_PER_STEP:
        return 16
    if panels <= 2 * sms:
        return 8
    if panels <= 8 * sms and 2 * panels >= t.awq_two_warp_min_warps * sms:
        return 2
    if rows >= t.awq_one_warp_min_rows and 8 * sms < panels <= 16 * sms:
        return 1
    if t.awq_four_warp_one_wave and panels <= 4 * sms:
        return 4
    return 8 if panels <= t.awq_wide_waves * 4 * sms else 4


def gemv_grid(m: int, n: int) -> tuple[int, int]:
    """One block per 16-channel panel and 8 * MT tokens."""
    return n // PANEL, cdiv(m, 8 * token_tile(m, AWQ_WIDEST_TILE))


def awq_packed_dequantize(p: AwqPacked, out: torch.Tensor | None = None) -> torch.Tensor:
    """w_hat fp16 [N, K] = fp16((q - z) * s), bit for bit model_zoo.quant.awq_pack.dequantize_awq (channel order
    of the packed weight)."""
    with build.on_stream():
        w_hat = out_or_new(out, (p.n, p.k), torch.float16, p.packed, "out")
        chunks = p.n * p.tiles * 16  # one thread per 16 bytes of w_hat (a tile of a channel is 256 bytes)
        fn = build.get_function("awq_gemv.cu", f"awq_packed_dequant_g{p.gpt}", "PPPiii")
        fn((cdiv(chunks, 256),), (256,), w_hat, p.packed, p.terms, p.n, p.k, p.tiles)
    return w_hat


def awq_linear_ref(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 product with w_hat (from the unpacked codes), rounded once to fp16; then residual or SwiGLU."""
    codes, zeros, scales = unpack_from_gemv(p)
    G = p.group_size
    w_hat = ((codes.double() - zeros.double().repeat_interleave(G, 1)) *
             scales.double().repeat_interleave(G, 1)).to(torch.float16)  # [N, K]
    y = (x.double() @ w_hat.double().t()).to(torch.float16)  # [M, N]
    if p.swiglu:
        return swiglu_interleaved(y)
    return y if residual is None else y + residual


def _check(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None) -> int:
    if x.dim() != 2 or x.shape[1] != p.k:
        raise ValueError(f"x must be [M, {p.k}], got {tuple(x.shape)}")
    check_tensor(x, "x", torch.float16)
    check_tensor(p.packed, "packed", torch.int32)
    check_tensor(p.terms, "terms", torch.int32)
    if residual is not None:
        if p.swiglu:
            raise ValueError("a SwiGLU gate|up op takes no residual")
        check_tensor(residual, "residual", torch.float16, (x.shape[0], p.n), align=2)
    return x.shape[0]
