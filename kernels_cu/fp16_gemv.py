"""fp16 linear layers of the engine (the baseline scheme): fp16_gemv.cu for decode, cuBLAS beyond.

    y[m, n] = fp16(sum_k x[m, k] * weight[n, k])   fp32 accumulation   (+ residual[m, n], an fp16 add)

M <= 16: fp16_gemv, a tensor-core GEMV that streams the weight once (cuBLAS leaves a third of the
bandwidth unused at M = 1). Larger M: cuBLAS tensor-core GEMM through torch, the residual added in its
epilogue (beta = 1; within the reference's tolerance of the rounded product + fp16 add above).

SwiGLU: a gate|up weight interleaved by 8 (swiglu_layout.py) lets `fp16_swiglu` write silu(gate) * up from
the GEMV's epilogue; beyond 16 rows silu_mul_interleaved does it in one kernel after cuBLAS.

int8 weights with fp16 activations (`w8a16_linear`, the engine's int8 lm_head): the same GEMV on half the bytes,

    y[m, n] = fp16(w_scale[n] * sum_k x[m, k] * qweight[n, k])   (model_zoo.quant.int8's per-channel codes)

up to tuning.w8a16_gemv_max_m rows; above, each chunk of W8A16_CHUNK_ROWS channels dequantized to fp16 for cuBLAS.
"""

from __future__ import annotations

import torch

from kernels_cu import build, norm_fold, tuning
from kernels_cu.checks import check_multiple, check_tensor, out_or_new
from kernels_cu.gemm_shapes import (GEMV_RING_BYTES, GEMV_THREADS, GEMV_WARPS, gemv_grid, gemv_ring_bytes,
                                    gemv_shared, token_tile)
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.silu_mul import silu_mul_interleaved
from kernels_cu.swiglu_layout import swiglu_interleaved

DECODE_MAX_M = 16
# y, x, weight, residual, M, N, K, fold_w, fold_xg, fold_part, fold_in, eps, res_early
SIGNATURE = "PPPPiiiPPPPfi"
W8A16_CHUNK_ROWS = 8192  # channels dequantized at a time above it (an fp16 chunk of 16 MB at K = 1,024)
# y, x, qweight, w_scale, M, N, K, fold_in, eps
W8A16_SIGNATURE = "PPPPiiiPf"


def fp16_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
                fold_out: FoldOut | None = None, residual_settled: bool = False) -> torch.Tensor:
    """x fp16 [M, K], weight fp16 [N, K] -> y fp16 [M, N]: the GEMV kernel up to 16 rows, cuBLAS above.
    fold_in / fold_out: the deferred RMSNorm (norm_fold.py), GEMV rows only. residual_settled: the residual's
    writer is at least two launches back on this stream (common.cuh: a kernel overlaps only the one before it), so
    the GEMV reads it before its PDL wait; never for a residual the previous kernel wrote."""
    if x.dim() == 2 and x.shape[0] <= DECODE_MAX_M:
        return fp16_gemv(x, weight, residual, out, fold_in, fold_out, residual_settled)
    if fold_in is not None or fold_out is not None:
        raise ValueError(f"the deferred RMSNorm runs on the fp16 GEMV only (M <= {DECODE_MAX_M})")
    _check(x, weight, residual)
    with build.on_stream():
        if residual is None:
            return torch.matmul(x, weight.t(), out=out)  # [M, N]
        # cuBLAS with beta = 1: the residual added in its epilogue (within the reference's tolerance of
        # fp16_linear_ref's rounded product + fp16 add). torch first copies the residual into `out` (a
        # device-to-device copy where there was an add kernel) unless out is residual: the engine's form.
        return torch.addmm(residual, x, weight.t(), out=out)  # [M, N]


def fp16_gemv(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
              fold_out: FoldOut | None = None, residual_settled: bool = False) -> torch.Tensor:
    """The GEMV kernel for any M (it re-reads the weight once per 16 rows: meant for M <= 16); residual_settled as
    fp16_linear's."""
    M, K, N = _check(x, weight, residual)
    if fold_out is not None and residual is None:
        raise ValueError("a deferred-norm producer is the GEMV that adds the residual")
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, x, "out", align=2)
        if M == 0 or N == 0:
            return y
        res = "_res" if residual is not None else ""
        _launch(f"fp16_gemv_mt{token_tile(M)}{res}", y, x, weight, residual, fold_in, fold_out, residual_settled)
    return y


def fp16_swiglu(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                fold_in: FoldIn | None = None) -> torch.Tensor:
    """x fp16 [M, K], interleaved gate|up weight [2F, K] -> silu(x @ gate^T) * (x @ up^T) fp16 [M, F]."""
    M, K, N = _check(x, weight, None)
    check_multiple(N, 16, "an interleaved gate|up weight's rows")
    with build.on_stream():
        if M > DECODE_MAX_M:
            if fold_in is not None:
                raise ValueError(f"the deferred RMSNorm runs on the fp16 GEMV only (M <= {DECODE_MAX_M})")
            return silu_mul_interleaved(torch.matmul(x, weight.t()), out)  # [M, 2F] -> [M, F]
        y = out_or_new(out, (M, N // 2), torch.float16, x, "out", align=2)
        if M:
            _launch(f"fp16_gemv_mt{token_tile(M)}_silu", y, x, weight, None, fold_in, None)
    return y


def _launch(name: str, y, x, weight, residual, fold_in: FoldIn | None, fold_out: FoldOut | None,
            residual_settled: bool = False) -> None:
    M, K = x.shape
    N = weight.shape[0]
    norm_fold.check_out(fold_out, M, N)
    norm_fold.check_in(fold_in, M, K)
    fn = build.get_function("fp16_gemv.cu", name, SIGNATURE)
    grid = gemv_grid(M, N)
    fn(grid, (GEMV_THREADS,), y, x, weight, residual, M, N, K, *norm_fold.out_args(fold_out),
       *norm_fold.in_args(fold_in), int(residual_settled), shared=gemv_shared(grid[0] * grid[1], GEMV_RING_BYTES))


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None,
                 fold_in: FoldIn | None = None) -> torch.Tensor:
    """x fp16 [M, K], qweight int8 [N, K], w_scale fp32 [N] -> y fp16 [M, N]: the GEMV up to w8a16_gemv_max_m
    rows (fold_in: the deferred RMSNorm), cuBLAS on dequantized chunks above (the weight rounded to fp16 once)."""
    if x.dim() != 2 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]:
        raise ValueError(f"x [M, K] and qweight [N, K] expected, got {tuple(x.shape)} and {tuple(qweight.shape)}")
    (M, K), N = x.shape, qweight.shape[0]
    check_multiple(K, 16, "the int8-weight GEMV's K")
    check_tensor(x, "x", torch.float16)
    check_tensor(qweight, "qweight", torch.int8)
    check_tensor(w_scale, "w_scale", torch.float32, (N,), align=4)
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, x, "out", align=2)
        if M == 0 or N == 0:
            return y
        max_m = tuning.current().w8a16_gemv_max_m
        if M <= max_m:
            norm_fold.check_in(fold_in, M, K)
            panels, tiles = gemv_grid(M, N)
            grid = (tiles, panels)  # a panel's token tiles side by side
            warps = w8a16_warps(M, K)
            suffix = "" if warps == GEMV_WARPS else f"_w{warps}"
            fn = build.get_function("fp16_gemv.cu", f"w8a16_gemv_mt{token_tile(M)}{suffix}", W8A16_SIGNATURE)
            fn(grid, (32 * warps,), y, x, qweight, w_scale, M, N, K, *norm_fold.in_args(fold_in),
               shared=gemv_shared(grid[0] * grid[1], gemv_ring_bytes(warps)))
            return y
        if fold_in is not None:
            raise ValueError(f"the deferred RMSNorm runs on the int8-weight GEMV only (M <= {max_m})")
        w = torch.empty(min(N, W8A16_CHUNK_ROWS), K, dtype=torch.float16, device=x.device)
        for n0 in range(0, N, W8A16_CHUNK_ROWS):
            n1 = min(N, n0 + W8A16_CHUNK_ROWS)
            # one kernel: code * scale in fp32, rounded to fp16 as it is stored (dequantize_weight_int8's bits)
            wc = torch.mul(qweight[n0:n1], w_scale[n0:n1, None], out=w[:n1 - n0])  # [n1 - n0, K]
            y[:, n0:n1] = torch.matmul(x, wc.t())
    return y


def w8a16_warps(m: int, k: int) -> int:
    """Warps of the int8-weight GEMV's blocks: 4 for one token tile up to w8a16_four_warp_max_k, else 8."""
    return 4 if token_tile(m) == 1 and k <= tuning.current().w8a16_four_warp_max_k else GEMV_WARPS


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float64 sums of x * code, times the channel's scale, rounded once to fp16."""
    return ((x.double() @ qweight.double().t()) * w_scale.double()).to(torch.float16)  # [M, N]


def fp16_swiglu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float64 products rounded to fp16, then torch's fp16 SiLU and multiply."""
    return swiglu_interleaved(fp16_linear_ref(x, weight))  # [M, F]


def fp16_linear_ref(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 product rounded once to fp16, then the fp16 residual add."""
    y = (x.double() @ weight.double().t()).to(torch.float16)  # [M, N]
    return y if residual is None else y + residual


def _check(x, weight, residual) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has K={K} but weight is {tuple(weight.shape)}")
    check_multiple(K, 8, "the fp16 GEMV's K")
    check_tensor(x, "x", torch.float16)
    check_tensor(weight, "weight", torch.float16)
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (M, N), align=2)
    return M, K, N
