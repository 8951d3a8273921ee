"""FP8 E4M3 W8A8 linears (fp8_gemm.cu, fp8_wgmma.cu) and their torch references: model_zoo/quant/fp8.py's contract.

    acc[m, n] = sum_k x8[m, k] * w8[n, k]                          fp32 (each e4m3 product is exact)
    y[m, n]   = fp16((acc * a_scale[m]) * w_scale[n])              (+ residual[m, n], an fp16 add)

x8 are the activation codes fp8_quantize.fp8_quantize made (per-token or static scales), w8 the weight codes
float8_e4m3fn [N, K] with a scale per output channel. Only the order of the fp32 sums differs from the CPU
reference, so the outputs agree to fp32 summation order, and the decode GEMV quantizes its input exactly as the
prefill GEMM does: decode and prefill share one numeric, the reference's.

Up to tuning.fp8_gemv_max_m rows: fp8_gemv (decode), a memory-bound tensor-core GEMV that converts both operands to
exact fp16 in registers; it reads the same bytes as the int8 GEMV; on Hopper the wide products of 17-32 rows run
fp8_wgmma_decode instead (wgmma e4m3, no conversions; tuning.fp8_wgmma_decode*). More rows on Hopper: fp8_wgmma
(wgmma e4m3, f32 accumulators); elsewhere (Ada) the GEMV at any M. `fp8_linear` (the engine's call) quantizes first,
or up to tuning.fp8_xq_max_rows rows runs fp8_gemv_xq, which quantizes its fp16 input itself: the same codes and
sums, bit for bit, and no quantize kernel in the decode step (one row: fp8_gemv_xq1, whose warps share the row's
work). `fp8_linear_norm` takes a NormIn (an RMSNorm's input and weight) and runs fp8_gemv_nq, which also applies the
norm: rmsnorm + fp8_quantize + fp8_gemv's bits, and no norm kernel. `fp8_swiglu`: a gate|up weight interleaved by 8
(swiglu_layout.py, w_scale in the same order) -> silu(gate) * up [M, F] from either kernel's epilogue.

The one-row decode chain (int8's, deferred_quant.cuh): `fp8_gemm_deferred` takes a DeferredQuant (fp16 x and its row
max from the kernel before: attention's units, or the SwiGLU GEMV's atomic max) and may write the next RMSNorm's
inputs (FoldOut in int8's format); `fp8_gemm_fold` takes a FoldQuant (that norm deferred: xg and its producer's
maxima and sums), with the SwiGLU and its row max for the down_proj after it. No kernel reads a whole row to find
its scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu import build, fp8_wgmma, fp8_wgmma_decode, norm_fold, tuning
from kernels_cu.checks import check_multiple, check_tensor, out_or_new, row_launch
from kernels_cu.fp8_contract import CODES, check_act_scale, check_weight, fp8_gemm_ref, fp8_swiglu_ref
from kernels_cu.fp8_quantize import (FP8, FP8_MAX, MIN_AMAX, check_static_scale, fp8_quantize, fp8_quantize_fold,
                                     fp8_quantize_ref)
from kernels_cu.gemm_shapes import (GEMV_RING_BYTES, GEMV_ROWS, GEMV_THREADS, cdiv, gemv_shared, sm_count, smem_per_sm,
                                   token_tile)
from kernels_cu.int8_gemm import DeferredQuant
from kernels_cu.norm_fold import FoldOut
from kernels_cu.quantize import check_fold_inputs
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_ref
from model_zoo.errors import ConfigError

# fp8_gemv_mt*: fp8_wgmma.SIGNATURE's (y, x8, a_scale, a_stride, w8, w_scale, residual, M, N, K) with fold_w,
# fold_xg, fold_sq, fold_mx and part before M
GEMV_SIGNATURE = "PPPiPPPPPPPPiii"
XQ_SIGNATURE = "PPPPPPiii"  # fp8_gemv_xq*: y, x, static_scale, w8, w_scale, residual, M, N, K
XQ_ROWS = 8  # token rows a self-quantizing GEMV block takes
NQ_SIGNATURE = "PPPfiiPPPiii"  # fp8_gemv_nq*: y, h, norm_w, eps, threads, nv, static_scale, w8, w_scale, M, N, K
DQ_SIGNATURE = "PPPiPPPPPPPPPiii"  # fp8_gemv_dq1[_res]: int8_gemv_xq1's arguments
FQ_SIGNATURE = "PPPPPPPfiPPPiii"  # fp8_gemv_fq1[_silu]: int8_gemv_nq1's arguments


def fp8_gemm(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             wgmma: bool | None = None, fold_out: FoldOut | None = None) -> torch.Tensor:
    """x8 e4m3 [M, K], a_scale fp32 [M] or [1], w8 e4m3 [N, K], w_scale fp32 [N] -> y fp16 [M, N] (+ residual).
    x8 may also be the codes' exact fp16 values (fp8_quantize_fold(values=True)): the GEMV then converts only the
    weights (fp8_gemv_h*, 8 or 16 rows a block).

    wgmma: None chooses the kernel (fp8_wgmma_decode.runs, fp8_wgmma.takes); True forces fp8_wgmma.cu at any M
    (tests, benchmarks: an sm_90 GPU, N % 16 == 0); False the GEMV at any M. fold_out (the GEMV or the decode GEMM,
    with the residual): the next RMSNorm deferred in int8's format, its xg, sums and maxima per 8 channels written."""
    M, K, N = _check(x8, a_scale, w8, w_scale, residual)
    if fold_out is not None:
        if residual is None:
            raise ValueError("an fp8 GEMV defers the next RMSNorm with its residual")
        norm_fold.check_out(fold_out, M, N, int8=True)
        wgmma = None if wgmma is None else False  # fp8_wgmma.cu writes no fold (None: the GEMV or the decode GEMM)
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, x8, "out", align=4)
        _run(y, x8, a_scale, w8, w_scale, residual, "res" if residual is not None else "plain", wgmma, fold_out)
    return y


def fp8_swiglu(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               out: torch.Tensor | None = None, wgmma: bool | None = None,
               part: torch.Tensor | None = None) -> torch.Tensor:
    """The gate|up linear with the SwiGLU in its epilogue: w8 [2F, K] and w_scale [2F] interleaved by 8
    (swiglu_layout.interleave_gate_up) -> silu(gate) * up fp16 [M, F], silu_mul's rounding of the two products.
    part fp32 [M, F / 8] (the GEMV or the decode GEMM): also each 8 channels' max |y|, for a down_proj's
    fp8_quantize_fold."""
    M, K, N2 = _check(x8, a_scale, w8, w_scale, None)
    check_multiple(N2, 16, "an interleaved gate|up weight's rows")
    if part is not None:
        check_tensor(part, "part", torch.float32, (M, N2 // 16), align=4)
        wgmma = None if wgmma is None else False  # fp8_wgmma.cu writes no maxima
    with build.on_stream():
        y = out_or_new(out, (M, N2 // 2), torch.float16, x8, "out", align=4)
        _run(y, x8, a_scale, w8, w_scale, None, "silu", wgmma, part=part)
    return y


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, static_scale: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, swiglu: bool = False, xq: bool | None = None) -> torch.Tensor:
    """The whole fp8 linear of an fp16 input x [M, K]: fp8_quantize (per token, or static_scale fp32 [1]), then
    fp8_gemm (+ residual) or, with swiglu, fp8_swiglu (w8, w_scale interleaved). xq: the GEMV quantizes x itself
    (fp8_gemv_xq, the same bits; None: up to tuning.fp8_xq_max_rows rows)."""
    if swiglu and residual is not None:
        raise ValueError("the SwiGLU epilogue takes no residual")
    if xq is None:
        xq = x.dim() == 2 and x.shape[0] <= tuning.current().fp8_xq_max_rows
    if xq:
        return _xq(x, w8, w_scale, static_scale, residual, swiglu)
    x8, a_scale = fp8_quantize(x, static_scale)
    if swiglu:
        return fp8_swiglu(x8, a_scale, w8, w_scale)
    return fp8_gemm(x8, a_scale, w8, w_scale, residual)


@dataclass(frozen=True)
class NormIn:
    """An fp8 linear's input that is still an RMSNorm's: h fp16 [M, K] (the residual stream) and the norm's weight
    fp16 [K] and eps. fp8_linear_norm normalizes and quantizes it inside the GEMV (rmsnorm + fp8_quantize's bits)."""

    h: torch.Tensor
    w: torch.Tensor
    eps: float

    def normed(self) -> torch.Tensor:
        """rmsnorm(h, w, eps) [M, K], the norm kernel's output, for a consumer that does not take NormIn."""
        return rmsnorm(self.h, self.w, self.eps)


def norm_launch(k: int) -> tuple[int, int] | None:
    """(vectors a thread, threads) of rmsnorm.cu's launch for a row of k, which fp8_gemv_nq's 256 threads emulate:
    None where the norm kernel takes more threads (rows beyond 16,384 values)."""
    try:
        nv, threads = row_launch(k // 8)
    except ConfigError:  # beyond the row kernels' limit: no norm kernel to match either
        return None
    return (nv, threads) if threads <= GEMV_THREADS else None


def fp8_linear_norm(x: NormIn, w8: torch.Tensor, w_scale: torch.Tensor, static_scale: torch.Tensor | None = None,
                    swiglu: bool = False) -> torch.Tensor:
    """fp8_linear(rmsnorm(x.h, x.w, x.eps), ...) in one kernel (fp8_gemv_nq[_silu], 8 rows a block; meant for few
    rows): the same bits."""
    h = x.h
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D, got {tuple(h.shape)}")
    M, K, N = check_weight(h, w8, w_scale, None)
    launch = norm_launch(K)
    if launch is None:
        return fp8_linear(x.normed(), w8, w_scale, static_scale, swiglu=swiglu, xq=True)
    check_tensor(h, "h", torch.float16)
    check_tensor(x.w, "norm weight", torch.float16, (K,))
    check_static_scale(static_scale)
    if swiglu:
        check_multiple(N, 16, "an interleaved gate|up weight's rows")
    with build.on_stream():
        y = torch.empty((M, N // 2 if swiglu else N), dtype=torch.float16, device=h.device)  # [M, F] or [M, N]
        if M == 0 or N == 0:
            return y
        name = f"fp8_gemv_nq{_one_row(M)}{'_silu' if swiglu else ''}"
        fn = build.get_function("fp8_gemm.cu", name, NQ_SIGNATURE)
        grid = (cdiv(M, XQ_ROWS), cdiv(N, GEMV_ROWS))
        nv, threads = launch
        fn(grid, (GEMV_THREADS,), y, h, x.w, float(x.eps), threads, nv, static_scale, w8, w_scale, M, N, K,
           shared=gemv_shared(grid[0] * grid[1], GEMV_RING_BYTES))
    return y


def _xq(x, w8, w_scale, static_scale, residual, swiglu: bool) -> torch.Tensor:
    """fp8_gemv_xq[_res|_silu] on fp16 x [M, K] (8 rows a block; meant for a few rows)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got {tuple(x.shape)}")
    M, K, N = check_weight(x, w8, w_scale, residual)
    check_tensor(x, "x", torch.float16)
    check_static_scale(static_scale)
    if swiglu:
        check_multiple(N, 16, "an interleaved gate|up weight's rows")
    with build.on_stream():
        y = torch.empty((M, N // 2 if swiglu else N), dtype=torch.float16, device=x.device)  # [M, F] or [M, N]
        if M == 0 or N == 0:
            return y
        suffix = "_silu" if swiglu else "_res" if residual is not None else ""
        fn = build.get_function("fp8_gemm.cu", f"fp8_gemv_xq{_one_row(M)}{suffix}", XQ_SIGNATURE)
        grid = (cdiv(M, XQ_ROWS), cdiv(N, GEMV_ROWS))
        fn(grid, (GEMV_THREADS,), y, x, static_scale, w8, w_scale, residual, M, N, K,
           shared=gemv_shared(grid[0] * grid[1], GEMV_RING_BYTES))
    return y


@dataclass(frozen=True)
class FoldQuant:
    """An fp8 linear's input that is an RMSNorm deferred into its producer in int8's format (norm_fold.py,
    FoldOut.new(w, M, int8=True)): xg fp16 [1, K] = h * w, mx / sq fp32 [1, C] the maxima of |xg| and sums of h^2 per
    8 channels (sq None: no norm), eps; zero fp32 [1] or None: set to 0 by the GEMV (a later SwiGLU GEMV's row max).
    fp8_gemm_fold quantizes xg by its own max with rstd in a_scale (dynamic), or by the static scale times rstd:
    fp8_fold_quantize_ref's codes, one fp16 rounding fewer than rmsnorm + fp8_quantize (as int8's fold)."""

    xg: torch.Tensor
    mx: torch.Tensor
    sq: torch.Tensor | None
    eps: float
    zero: torch.Tensor | None = None


def fp8_gemm_deferred(xq: DeferredQuant, w8: torch.Tensor, w_scale: torch.Tensor,
                      static_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      fold_out: FoldOut | None = None) -> torch.Tensor:
    """fp8_linear of fp16 rows x [M, K] whose scales need no read of them: xq.row_amax (the max itself), xq.part
    (partial maxima), or, with neither, static_scale. One row: fp8_gemv_dq1[_res]; more: fp8_quantize_fold (from
    xq.part) or fp8_quantize (static), then the GEMV; fp8_quantize + fp8_gemv's bits. fold_out (with the residual):
    the next RMSNorm deferred, its xg, sums and maxima per 8 channels written as well."""
    x, part, row_amax = xq.x, xq.part, xq.row_amax
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got {tuple(x.shape)}")
    if x.shape[0] != 1:
        if part is not None:
            x8, a_scale = fp8_quantize_fold(x, part, values=tuning.current().fp8_gemv_fp16_x)
        elif static_scale is not None and row_amax is None:
            x8, a_scale = fp8_quantize(x, static_scale)
        else:
            raise ValueError("a deferred fp8 quantization of several rows needs their partial maxima or a static scale")
        return fp8_gemm(x8, a_scale, w8, w_scale, residual, fold_out=fold_out)
    M, K, N = check_weight(x, w8, w_scale, residual)
    check_tensor(x, "x", torch.float16, align=16)  # the lanes' 4-byte reads
    if part is not None:
        if part.dim() != 2 or part.shape[0] != 1 or part.shape[1] == 0:
            raise ValueError(f"part must be [1, C] with C > 0, got {tuple(part.shape)}")
        check_tensor(part, "part", torch.float32, align=4)
    if row_amax is not None:
        check_tensor(row_amax, "row_amax", torch.float32, (1,), align=4)
    if part is None and row_amax is None:
        if static_scale is None:
            raise ValueError("a deferred fp8 quantization needs the row's maxima or a static scale")
        check_static_scale(static_scale)
    if fold_out is not None:
        if residual is None:
            raise ValueError("an fp8 GEMV defers the next RMSNorm with its residual")
        norm_fold.check_out(fold_out, M, N, int8=True)
    fold = (None,) * 4 if fold_out is None else (fold_out.w, fold_out.xg, fold_out.part, fold_out.mx)
    with build.on_stream():
        y = torch.empty((M, N), dtype=torch.float16, device=x.device)  # [1, N]
        if N == 0:
            return y
        fn = build.get_function("fp8_gemm.cu", f"fp8_gemv_dq1{'_res' if residual is not None else ''}",
                                DQ_SIGNATURE)
        blocks = cdiv(N, GEMV_ROWS)
        fn((1, blocks), (GEMV_THREADS,), y, x, part, 0 if part is None else part.shape[1], row_amax,
           static_scale if part is None and row_amax is None else None, w8, w_scale, residual, *fold, M, N, K,
           shared=gemv_shared(blocks, GEMV_RING_BYTES))
    return y


def fp8_gemm_fold(fq: FoldQuant, w8: torch.Tensor, w_scale: torch.Tensor, static_scale: torch.Tensor | None = None,
                  swiglu: bool = False, row_amax: torch.Tensor | None = None,
                  maxima: bool = False) -> torch.Tensor | DeferredQuant:
    """The fp8 linear of a deferred RMSNorm's rows -> y fp16 [T, N], or with swiglu (w8 interleaved by 8)
    silu(gate) * up [T, F]; with swiglu and maxima DeferredQuant(silu(gate) * up, part [T, F / 8], row_amax) for a
    down_proj that quantizes it from its maxima. One row: fp8_gemv_fq1[_silu], and row_amax fp32 [1] (zero on
    entry) gets the row's max (an atomic max of the blocks' maxima); fq.zero must be another buffer (a GEMV cannot
    clear what its own blocks accumulate). More rows: fp8_quantize_fold, then the GEMV (no row_amax, no zero)."""
    T, K, C = check_fold_inputs(fq.xg, fq.mx, fq.sq, None, fq.zero)
    if T != 1:
        if row_amax is not None or fq.zero is not None:
            raise ValueError("row_amax and zero are the one-row GEMV's")
        x8, a_scale = fp8_quantize_fold(fq.xg, fq.mx, fq.sq, fq.eps, static_scale,
                                        values=tuning.current().fp8_gemv_fp16_x)
        if not swiglu:
            return fp8_gemm(x8, a_scale, w8, w_scale)
        part = torch.empty((T, w8.shape[0] // 16), dtype=torch.float32, device=x8.device) if maxima else None
        y = fp8_swiglu(x8, a_scale, w8, w_scale, part=part)  # [T, F]
        return DeferredQuant(y, part) if maxima else y
    check_tensor(fq.xg, "xg", torch.float16, align=16)
    check_static_scale(static_scale)
    M, K, N = check_weight(fq.xg, w8, w_scale, None)
    if row_amax is not None or maxima:
        if not (swiglu and maxima):
            raise ValueError("maxima and row_amax are the SwiGLU epilogue's")
    if row_amax is not None:
        check_tensor(row_amax, "row_amax", torch.float32, (1,), align=4)
        if fq.zero is not None and fq.zero.data_ptr() == row_amax.data_ptr():
            raise ValueError("fp8_gemm_fold: the GEMV cannot clear the row max it accumulates (clear it earlier)")
    if swiglu:
        check_multiple(N, 16, "an interleaved gate|up weight's rows")
    with build.on_stream():
        y = torch.empty((1, N // 2 if swiglu else N), dtype=torch.float16, device=fq.xg.device)  # [1, F] or [1, N]
        part = torch.empty((1, N // 16), dtype=torch.float32, device=fq.xg.device) if maxima else None  # [1, F/8]
        if N:
            fn = build.get_function("fp8_gemm.cu", f"fp8_gemv_fq1{'_silu' if swiglu else ''}", FQ_SIGNATURE)
            blocks = cdiv(N, GEMV_ROWS)
            fn((1, blocks), (GEMV_THREADS,), y, part, row_amax, fq.xg, fq.mx, fq.sq, static_scale, float(fq.eps), C,
               fq.zero, w8, w_scale, M, N, K, shared=gemv_shared(blocks, GEMV_RING_BYTES))
    return DeferredQuant(y, part, row_amax=row_amax) if maxima else y


def fp8_fold_quantize_ref(fq: FoldQuant, static_scale: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 float8_e4m3fn [T, K], a_scale fp32 [T]) of a deferred RMSNorm as fp8_gemv_fq1 quantizes it, rstd in
    float64 (the kernel's rsqrtf is within 2 ulp): dynamic, xg's codes by its max and a_scale = amax / 448 * rstd;
    static, the codes of xg * (rstd / scale) and a_scale = scale."""
    xg = fq.xg.float()  # [T, K]
    K = xg.shape[1]
    rstd = (torch.ones(xg.shape[0], dtype=torch.float64, device=xg.device) if fq.sq is None else
            torch.rsqrt(fq.sq.double().sum(1) / K + fq.eps))  # [T]
    # tensor / tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply
    if static_scale is None:
        amax = fq.mx.float().amax(1).clamp_min(MIN_AMAX)  # [T]
        scale = amax / torch.full_like(amax, FP8_MAX)  # [T]
        inv, a_scale = torch.ones_like(scale) / scale, (scale.double() * rstd).float()
    else:
        s = static_scale.float().reshape(1).expand(xg.shape[0]).contiguous()  # [T]
        inv, a_scale = ((torch.ones_like(s) / s).double() * rstd).float(), s
    x8 = (xg * inv[:, None]).clamp(-448.0, 448.0).to(FP8)  # [T, K]
    return x8, a_scale


def _one_row(m: int) -> str:
    """The entry suffix of the self-quantizing GEMVs: "1" (the one-row loader: the warp shares a row's
    quantization) for one row, else "" (each lane quantizes its own token row's values)."""
    return "1" if m == 1 else ""


def _run(y, x8, a_scale, w8, w_scale, residual, epilogue: str, wgmma: bool | None, fold_out: FoldOut | None = None,
         part: torch.Tensor | None = None) -> None:
    M, N = x8.shape[0], w8.shape[0]
    if M == 0 or N == 0:
        return
    values = x8.dtype == torch.float16  # the codes' fp16 values: the h entries, never the wgmma GEMM
    if wgmma is None and fp8_wgmma_decode.runs(x8, w8):  # wide products of 17-32 rows on Hopper
        fp8_wgmma_decode.launch(y, x8, a_scale, w8, w_scale, residual, epilogue, fold_out, part)
        return
    if wgmma is None:  # the GEMM beyond the GEMV's rows, or cuBLASLt's from tuning.fp8_library_min_m rows
        side = fold_out is not None or part is not None  # outputs only the GEMVs write
        wgmma = not (values or side) and (fp8_wgmma.takes(x8, N) or fp8_wgmma.library_runs(x8, N))
    elif wgmma and (values or N % 16 or not build.has_wgmma(x8.device.index or 0)):
        raise ValueError(f"fp8_wgmma needs an sm_90 GPU and N % 16 == 0, got N={N}")
    a_stride = 1 if a_scale.numel() == M else 0
    if wgmma:
        fp8_wgmma.launch(y, x8, a_scale, a_stride, w8, w_scale, residual, epilogue)
        return
    suffix = "" if epilogue == "plain" else f"_{epilogue}"
    t = tuning.current()
    mt = token_tile(M, widest=2 if values else t.fp8_gemv_block_rows // 8)
    warps = 0 if values or mt != 4 else _wide_warps(t, M, N, x8)
    if warps:  # 32 channels a block (fp8_gemv_w2x*)
        _run_wide(warps, suffix, y, x8, a_scale, a_stride, w8, w_scale, residual, fold_out, part)
        return
    alu = "a" if mt == 4 and t.fp8_gemv_alu_weights else ""  # fp8_gemv_mt4a: weights converted by integer ops
    name = f"fp8_gemv_h{mt}" if values else f"fp8_gemv_mt{mt}{alu}"
    fn = build.get_function("fp8_gemm.cu", f"{name}{suffix}", GEMV_SIGNATURE)
    panels, tiles = cdiv(N, GEMV_ROWS), cdiv(M, 8 * mt)
    grid = (tiles, panels)  # a panel's token tiles side by side (they share its lines in L2)
    ring = GEMV_RING_BYTES // 2 if mt == 4 or values else GEMV_RING_BYTES  # steps of two tiles
    fold = (None,) * 4 if fold_out is None else (fold_out.w, fold_out.xg, fold_out.part, fold_out.mx)
    fn(grid, (GEMV_THREADS,), y, x8, a_scale, a_stride, w8, w_scale, residual, *fold, part, M, N, x8.shape[1],
       shared=gemv_shared(tiles * panels, ring))


def _wide_warps(t: tuning.Tuning, M: int, N: int, x8: torch.Tensor) -> int:
    """Warps a block of fp8_gemv_w2x* (32 channels a block, tuning.fp8_gemv_block_channels), or 0: fp8_gemv_mt4 (16;
    mt4a with tuning.fp8_gemv_alu_weights), or where the ring does not fit the device's shared memory. 4 where the
    grid exceeds the SMs (two blocks a SM, tuning.fp8_gemv_wide_two_blocks), else 8."""
    if t.fp8_gemv_block_channels not in (16, 32):
        raise ConfigError(f"fp8_gemv_block_channels must be 16 or 32, got {t.fp8_gemv_block_channels}")
    index = x8.device.index or 0
    if t.fp8_gemv_block_channels == 16 or t.fp8_gemv_alu_weights or smem_per_sm(index) < wide_ring(8) + 4096:
        return 0
    return 4 if t.fp8_gemv_wide_two_blocks and cdiv(M, 32) * cdiv(N, 32) > sm_count(index) else 8


def wide_ring(warps: int) -> int:
    """Shared bytes of fp8_gemv_w2x*'s ring (WideShape): 3 stages of 32 weight and 32 token rows of 128 bytes."""
    return warps * 3 * 64 * 128


def _run_wide(warps: int, suffix: str, y, x8, a_scale, a_stride, w8, w_scale, residual, fold_out, part) -> None:
    """fp8_gemv_w2x{warps}: 32 token rows x 32 channels a block (fp8_gemv_wide.cu)."""
    check_tensor(x8, "x8", CODES, align=16)  # the token rows' cp.async
    M, N = x8.shape[0], w8.shape[0]
    fn = build.get_function("fp8_gemv_wide.cu", f"fp8_gemv_w2x{warps}{suffix}", GEMV_SIGNATURE)
    fold = (None,) * 4 if fold_out is None else (fold_out.w, fold_out.xg, fold_out.part, fold_out.mx)
    fn((cdiv(M, 32), cdiv(N, 32)), (32 * warps,), y, x8, a_scale, a_stride, w8, w_scale, residual, *fold, part, M,
       N, x8.shape[1], shared=wide_ring(warps))


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, static_scale=None,
                   residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """fp8_linear's reference: fp8_quantize_ref, then fp8_gemm_ref or fp8_swiglu_ref."""
    x8, a_scale = fp8_quantize_ref(x, static_scale)
    if swiglu:
        return fp8_swiglu_ref(x8, a_scale, w8, w_scale)
    return fp8_gemm_ref(x8, a_scale, w8, w_scale, residual)


def fp8_linear_norm_ref(x: NormIn, w8: torch.Tensor, w_scale: torch.Tensor, static_scale=None,
                        swiglu: bool = False) -> torch.Tensor:
    """fp8_linear_ref of rmsnorm_ref(h, w, eps) (the norm kernel's rounding)."""
    return fp8_linear_ref(rmsnorm_ref(x.h, x.w, x.eps), w8, w_scale, static_scale, swiglu=swiglu)


def _check(x8, a_scale, w8, w_scale, residual) -> tuple[int, int, int]:
    if x8.dim() != 2:
        raise ValueError(f"x8 must be 2-D, got {tuple(x8.shape)}")
    M, K, N = check_weight(x8, w8, w_scale, residual)
    check_tensor(x8, "x8", CODES + (torch.float16,), align=16 if x8.dtype == torch.float16 else 1)
    check_act_scale(a_scale, M)
    return M, K, N
