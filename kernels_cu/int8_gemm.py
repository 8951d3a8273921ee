"""W8A8 GEMM with the dequant epilogue (int8_gemm.cu), and its torch reference.

    acc[m, n] = sum_k q_x[m, k] * qweight[n, k]                       exact int32
    y[m, n]   = fp16((float(acc) * a_scale[m]) * w_scale[n])          (+ residual[m, n], an fp16 add)

M <= 16 (decode): int8_gemv, a memory-bound tensor-core kernel that reads each weight byte once.
On Hopper, where its grid fills the SMs: int8_wgmma.cu, a wgmma GEMM with the epilogue fused. Other M > 16:
torch._int_mm (cuBLASLt int8, needs M > 16 and K, N multiples of 8) and the dequant epilogue kernel.
a_scale holds one scale per token [M] or one for the tensor [1].

Deferred quantization (decode, a few rows): `int8_swiglu` writes the SwiGLU of the gate|up product in fp16
with each block's row maxima, and `int8_gemm` given a `DeferredQuant` (fp16 x + the partial maxima that its
producer wrote: int8_swiglu, or attention_decode_rope_parts) quantizes x inside the GEMV, by quantize.py's rule
with the same bits, so neither silu_mul_part nor quantize_fold (nor attention's own quantization round) runs.

Deferred RMSNorm (norm_fold.py, int8 decode up to DECODE_MAX_M rows): the residual GEMV (int8_gemm or
int8_gemm_deferred with fold_out) can write the next norm's FoldOut (FoldOut.new(w, M, int8=True): xg = h * w, the
sums of h^2 and maxima of |xg| per 8 channels), which quantize.quantize_fold turns into the next GEMV's input
instead of rmsnorm_quant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_zoo.quant.int8 import int8_gemm_ref as _contract_gemm
from kernels_cu import build, int8_wgmma, norm_fold, tuning
from kernels_cu.checks import check_multiple, check_static_amax, check_tensor, out_or_new
from kernels_cu.gemm_shapes import (GEMV_RING_BYTES, GEMV_THREADS, cdiv, gemv_grid, gemv_shared, gemv_xq_shared,
                                    token_tile)
from kernels_cu.norm_fold import FoldOut
from kernels_cu.quantize import check_fold_inputs, quantize, quantize_fold

DECODE_MAX_M = 16  # torch._int_mm refuses M <= 16; the GEMV kernel is the faster one there anyway
XQ_KERNEL_ROWS = 8  # rows the deferred-quantization GEMVs take (tuning.defer_quant_max_rows says how many run)
NQ_SIGNATURE = "PPPPPPPfiPPPiii"  # int8_gemv_nq1[_silu]
SILU_SIGNATURE = "PPPPPiPPiii"  # int8_gemv_mt{1,2}_silu
XQ_SIGNATURE = "PPPiPPPPPPPPPiiii"  # int8_gemv_xq[1][_res]


@dataclass(frozen=True)
class DeferredQuant:
    """An int8 GEMM input not yet quantized: x fp16 [M, K] and its row maxima as partial maxima part fp32 [M, C]
    (the max over each row of part is max |x| of that row), or, with part None, a static amax fp32 [1].
    row_amax fp32 [M], when given, is each row's max itself (int8_swiglu's atomic max): the GEMV reads it instead
    of reducing part."""

    x: torch.Tensor
    part: torch.Tensor | None
    static_amax: torch.Tensor | None = None
    row_amax: torch.Tensor | None = None

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q int8 [M, K], a_scale fp32 [M]) as quantize() gives for x (the row maxima found again), for a
        consumer that does not take the deferred form."""
        return quantize(self.x, self.static_amax if self.part is None else None)


def norm_in_loop(rows: int) -> bool:
    """Whether the GEMV after an int8 deferred RMSNorm of `rows` rows quantizes it itself (tuning.norm_row_loop)."""
    return rows == 1 and tuning.current().norm_row_loop


@dataclass(frozen=True)
class NormQuant:
    """An int8 GEMM input that is an RMSNorm an int8 producer deferred (norm_fold.py), not yet quantized: xg fp16
    [M, K] = h * w, mx / sq fp32 [M, C] the maxima of |xg| and sums of h^2 over C channel groups (sq None: no norm),
    eps, static_amax fp32 [1] or None (dynamic) — quantize_fold's inputs; zero fp32 [M] or None: set to 0 by the
    kernel that quantizes (a later int8_swiglu's row_amax). A one-row GEMV quantizes it in its main loop with
    quantize_fold's bits (in_loop); otherwise quantized() runs quantize_fold (early: see its docstring)."""

    xg: torch.Tensor
    mx: torch.Tensor
    sq: torch.Tensor | None
    eps: float
    static_amax: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    early: bool = False

    def in_loop(self) -> bool:
        return self.xg.dim() == 2 and norm_in_loop(self.xg.shape[0])

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fold(self.xg, self.mx, self.sq, self.eps, self.static_amax, early=self.early, zero=self.zero)


def _norm_launch(nq: NormQuant, qweight: torch.Tensor, w_scale: torch.Tensor, swiglu: bool,
                 row_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int8_gemv_nq1[_silu] on a one-row NormQuant -> (y [1, N] or [1, F], part [1, F / 8] or None)."""
    xg, mx, sq = nq.xg, nq.mx, nq.sq
    _, K, C = check_fold_inputs(xg, mx, sq, nq.static_amax, nq.zero)  # one row: in_loop()
    N = _check_weight("xg", 1, K, qweight, w_scale, None)
    check_tensor(xg, "xg", torch.float16, align=16)  # the lanes' 4-byte reads of it
    if row_amax is not None:
        check_tensor(row_amax, "row_amax", torch.float32, (1,), align=4)
    if swiglu:
        check_multiple(N, 16, "a fused gate|up weight's rows")
        N //= 2
    with build.on_stream():
        y = torch.empty((1, N), dtype=torch.float16, device=xg.device)  # [1, N]
        part = torch.empty((1, N // 8), dtype=torch.float32, device=xg.device) if swiglu else None  # [1, F / 8]
        if N == 0:
            return y, part
        fn = build.get_function("int8_gemm.cu", "int8_gemv_nq1_silu" if swiglu else "int8_gemv_nq1", NQ_SIGNATURE)
        blocks = N // 8 if swiglu else cdiv(N, 16)
        fn((blocks, 1), (GEMV_THREADS,), y, part, row_amax, xg, mx, sq, nq.static_amax, float(nq.eps), C, nq.zero,
           qweight, w_scale, 1, N, K, shared=gemv_shared(blocks, GEMV_RING_BYTES))
    return y, part


def int8_gemm_norm(nq: NormQuant, qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """int8_gemm of a deferred RMSNorm's output: int8_gemm(*nq.quantized(), qweight, w_scale)'s bits, the
    quantization in the GEMV at one row."""
    if not nq.in_loop():
        return int8_gemm(*nq.quantized(), qweight, w_scale)
    return _norm_launch(nq, qweight, w_scale, False, None)[0]


def int8_swiglu_norm(nq: NormQuant, qweight: torch.Tensor, w_scale: torch.Tensor,
                     row_amax: torch.Tensor | None = None) -> DeferredQuant:
    """int8_swiglu of a deferred RMSNorm's output (its bits, the quantization in the GEMV at one row). row_amax
    must be zero on entry, as for int8_swiglu; nq.zero clears another buffer, never this one (this kernel's own
    blocks write it)."""
    if not nq.in_loop():
        return int8_swiglu(*nq.quantized(), qweight, w_scale, row_amax)
    if row_amax is not None and nq.zero is not None and row_amax.data_ptr() == nq.zero.data_ptr():
        raise ValueError("int8_swiglu_norm: the GEMV cannot clear the row max it accumulates (clear it earlier)")
    y, part = _norm_launch(nq, qweight, w_scale, True, row_amax)
    return DeferredQuant(y, part, row_amax=row_amax)


def int8_gemm_deferred(xq: DeferredQuant, qweight: torch.Tensor, w_scale: torch.Tensor,
                       residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       fold_out: FoldOut | None = None, residual_settled: bool = False) -> torch.Tensor:
    """int8_gemm of an input whose quantization was deferred: the GEMV quantizes it (up to XQ_KERNEL_ROWS rows),
    the same bits as int8_gemm(*quantize(x)); more rows are quantized first. fold_out (with a residual): the next
    RMSNorm deferred, its xg, sums and maxima written as well (as int8_gemm's). residual_settled: its writer is at
    least two launches back, so the GEMV reads it before its PDL wait (awq_gemv.awq_linear's rule)."""
    x, part = xq.x, xq.part
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got {tuple(x.shape)}")
    M, K = x.shape
    if M > XQ_KERNEL_ROWS:
        return int8_gemm(*xq.quantized(), qweight, w_scale, residual, out, fold_out=fold_out)
    N = _check_weight("x", M, K, qweight, w_scale, residual)
    _check_fold_out(fold_out, M, N, residual, XQ_KERNEL_ROWS)
    check_tensor(x, "x", torch.float16, align=16)
    if part is not None:
        if part.dim() != 2 or part.shape[0] != M or part.shape[1] == 0:
            raise ValueError(f"part must be [{M}, C] with C > 0, got {tuple(part.shape)}")
        check_tensor(part, "part", torch.float32, align=4)
    elif xq.static_amax is None:
        raise ValueError("a deferred quantization needs partial maxima or a static amax")
    else:
        check_static_amax(xq.static_amax)
    row_amax = xq.row_amax if part is not None else None
    if row_amax is not None:
        check_tensor(row_amax, "row_amax", torch.float32, (M,), align=4)
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, x, "out", align=8)
        if M == 0 or N == 0:
            return y
        res = "_res" if residual is not None else ""
        row_loop = M == 1 and tuning.current().xq_row_loop
        fn = build.get_function("int8_gemm.cu", f"int8_gemv_xq{'1' if row_loop else ''}{res}", XQ_SIGNATURE)
        ring = GEMV_RING_BYTES if row_loop else gemv_xq_shared(M, K)
        fn((cdiv(N, 16), 1), (GEMV_THREADS,), y, x, part, 0 if part is None else part.shape[1], row_amax,
           xq.static_amax if part is None else None, qweight, w_scale, residual, *_fold_args(fold_out), M, N, K,
           int(residual_settled), shared=gemv_shared(cdiv(N, 16), ring))
    return y


def int8_swiglu(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor,
                w_scale: torch.Tensor, row_amax: torch.Tensor | None = None) -> DeferredQuant:
    """The gate|up GEMV with the SwiGLU in its epilogue, for M <= DECODE_MAX_M: q_x int8 [M, K], qweight int8
    [2F, K] (gate rows, then up rows), w_scale [2F] -> DeferredQuant(silu(gate) * up fp16 [M, F], part [M, F / 8]).
    The fp16 values are silu_mul(int8_gemm(...))'s bits. row_amax fp32 [M], zero on entry (the caller clears it:
    quantize_fold's `zero`): each row's max |y| accumulated there as well, and passed on in the DeferredQuant."""
    M, K, N2 = _check(q_x, a_scale, qweight, w_scale, None)
    if row_amax is not None:
        check_tensor(row_amax, "row_amax", torch.float32, (M,), align=4)
    if M > DECODE_MAX_M:
        raise ValueError(f"int8_swiglu runs the GEMV: at most {DECODE_MAX_M} rows, got {M}")
    check_multiple(N2, 16, "a fused gate|up weight's rows")
    F = N2 // 2
    with build.on_stream():
        y = torch.empty((M, F), dtype=torch.float16, device=q_x.device)  # [M, F]
        part = torch.empty((M, F // 8), dtype=torch.float32, device=q_x.device)  # [M, F / 8]
        if M:
            mt = token_tile(M)
            fn = build.get_function("int8_gemm.cu", f"int8_gemv_mt{mt}_silu", SILU_SIGNATURE)
            grid = (F // 8, cdiv(M, 8 * mt))
            fn(grid, (GEMV_THREADS,), y, part, row_amax, q_x, a_scale, 1 if a_scale.numel() == M else 0, qweight,
               w_scale, M, F, K, shared=gemv_shared(grid[0] * grid[1], GEMV_RING_BYTES))
    return DeferredQuant(y, part, row_amax=row_amax)


def int8_gemm(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
              residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              wgmma: bool | None = None, fold_out: FoldOut | None = None) -> torch.Tensor:
    """q_x int8 [M, K], a_scale fp32 [M] or [1], qweight int8 [N, K], w_scale fp32 [N] -> y fp16 [M, N].

    wgmma: None chooses the kernel (int8_wgmma.takes); True forces int8_wgmma.cu at any M (tests, benchmarks:
    needs an sm_90 GPU and N % 8 == 0); False keeps it off.
    fold_out (the decode GEMV with a residual, M <= DECODE_MAX_M): the next RMSNorm deferred, its xg, sums and
    maxima written as well (FoldOut.new(w, M, int8=True))."""
    M, K, N = _check(q_x, a_scale, qweight, w_scale, residual)
    _check_fold_out(fold_out, M, N, residual, DECODE_MAX_M)
    if fold_out is not None:
        wgmma = False
    if wgmma is None:
        wgmma = int8_wgmma.takes(q_x, N)
    elif wgmma and N % 8:
        raise ValueError(f"int8_wgmma needs N % 8 == 0, got N={N}")
    a_stride = 1 if a_scale.numel() == M else 0
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, q_x, "out", align=8)
        if M == 0 or N == 0:
            return y
        res = "_res" if residual is not None else ""
        if wgmma:
            int8_wgmma.launch(y, q_x, a_scale, a_stride, qweight, w_scale, residual)
        elif M > DECODE_MAX_M and N % 8 == 0 and not _gemv_above_decode(M, N):
            acc = torch._int_mm(q_x, qweight.t())  # [M, N] int32 (cuBLASLt, TN layout)
            fn = build.get_function("int8_gemm.cu", f"int8_dequant{res}", "PPPiPPii")
            fn((cdiv(M * N // 4, GEMV_THREADS),), (GEMV_THREADS,), y, acc, a_scale, a_stride, w_scale, residual, M, N)
        else:
            fn = build.get_function("int8_gemm.cu", f"int8_gemv_mt{token_tile(M)}{res}", "PPPiPPPPPPPiii")
            grid = gemv_grid(M, N)
            fn(grid, (GEMV_THREADS,), y, q_x, a_scale, a_stride, qweight, w_scale, residual,
               *_fold_args(fold_out), M, N, K, shared=gemv_shared(grid[0] * grid[1], GEMV_RING_BYTES))
    return y


def _gemv_above_decode(M: int, N: int) -> bool:
    """Whether a plain product of more than DECODE_MAX_M rows still runs the GEMV (tuning.int8_gemv_max_m / _n)."""
    t = tuning.current()
    return M <= t.int8_gemv_max_m and N <= t.int8_gemv_max_n


def int8_gemm_ref(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """The contract in torch (model_zoo.quant.int8: exact int32 product, the same two fp32 roundings)."""
    a = a_scale.float().reshape(-1).expand(q_x.shape[0])  # [M]
    y = _contract_gemm(q_x, qweight, a, w_scale.float(), torch.float16)  # [M, N]
    return y if residual is None else y + residual


def _check_fold_out(fold_out: FoldOut | None, M: int, N: int, residual: torch.Tensor | None, max_rows: int) -> None:
    """A producer's deferred next norm: only the decode GEMVs (up to max_rows rows) with a residual write one."""
    if fold_out is None:
        return
    if residual is None or M > max_rows:
        raise ValueError(f"an int8 GEMV defers the next RMSNorm with its residual, on at most {max_rows} "
                         f"rows here, got {M} rows{'' if residual is not None else ' and no residual'}")
    norm_fold.check_out(fold_out, M, N, int8=True)


def _fold_args(fold_out: FoldOut | None) -> tuple:
    """The entries' (fold_w, fold_xg, fold_sq, fold_mx)."""
    return (None,) * 4 if fold_out is None else (fold_out.w, fold_out.xg, fold_out.part, fold_out.mx)


def _check(q_x, a_scale, qweight, w_scale, residual) -> tuple[int, int, int]:
    if q_x.dim() != 2:
        raise ValueError(f"q_x must be 2-D, got {tuple(q_x.shape)}")
    M, K = q_x.shape
    N = _check_weight("q_x", M, K, qweight, w_scale, residual)
    check_tensor(q_x, "q_x", torch.int8)
    if a_scale.numel() not in (M, 1):
        raise ValueError(f"a_scale must hold {M} per-token scales or 1 per-tensor scale, got {a_scale.numel()}")
    check_tensor(a_scale, "a_scale", torch.float32, align=4)
    return M, K, N


def _check_weight(x_name: str, M: int, K: int, qweight, w_scale, residual) -> int:
    """The weight side of an int8 GEMM whose input `x_name` is [M, K]: qweight int8 [N, K], w_scale [N], the
    residual [M, N] -> N."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D, got {tuple(qweight.shape)}")
    N = qweight.shape[0]
    if qweight.shape[1] != K:
        raise ValueError(f"{x_name} has K={K} but qweight is {tuple(qweight.shape)}")
    check_multiple(K, 16, "the int8 GEMM's K")
    check_tensor(qweight, "qweight", torch.int8)
    check_tensor(w_scale, "w_scale", torch.float32, (N,), align=16)
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (M, N), align=8)
    return N
