"""The deferred RMSNorm (norm_fold.py): producers write h, xg = h * w and the partial sums of h^2; consumers
scale their sums by rstd. Producers' h and xg are bit for bit the unfolded residual epilogue and torch's fp16
h * w; consumers match the float64 product of the normalized rows rounded once, at the GEMVs' tolerance, and
give the same bits run after run."""

import pytest
import torch

from tests.gpu.conftest import (GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, check_gemm, check_swiglu, compare,
                                poison, randn)

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.awq_gemv import awq_linear, awq_linear_ref, folds, pack_for_gemv  # noqa: E402
from kernels_cu.embedding import embedding, embedding_fold  # noqa: E402
from kernels_cu.fp16_gemv import (fp16_linear, fp16_linear_ref, fp16_swiglu, fp16_swiglu_ref,  # noqa: E402
                                  w8a16_linear, w8a16_linear_ref)
from kernels_cu.norm_fold import FoldOut, fold_out_ref, rstd_ref  # noqa: E402
from kernels_cu.rmsnorm import rmsnorm_ref  # noqa: E402
from kernels_cu.swiglu_layout import interleave_gate_up  # noqa: E402

pytestmark = pytest.mark.gpu

EPS = 1e-5
ROWS = [1, 3, 8, 9, 16]


def check_fold(fold: FoldOut, h: torch.Tensor, what: str) -> None:
    """xg bitwise torch's fp16 h * w; the partial sums within fp32 summation error of float64."""
    xg, part = fold_out_ref(h, fold.w)
    assert_equal(fold.xg, xg, f"{what}: xg")
    compare(fold.part, part, rtol=1e-5, atol=1e-6 * float(part.abs().max()), what=f"{what}: part")


def check_consumer(run, ref: torch.Tensor, what: str) -> None:
    """A consumer GEMV run(out) into a poisoned output, against its float64 reference; the same bits again."""
    y = torch.empty_like(ref)
    poison(y)
    run(y)
    check_gemm(y, ref, what)
    assert_equal(run(None), y, f"{what}: run to run")


def folded(M: int, K: int, seed: int) -> tuple[torch.Tensor, FoldOut, torch.Tensor]:
    """A residual stream h [M, K] (rows of very different scales) through embedding_fold with a norm weight:
    (h, its FoldOut, the float64 normalized rows xg * rstd that a folded consumer multiplies by W)."""
    h = randn(M, K, seed=seed) * torch.linspace(0.05, 4.0, M, device="cuda", dtype=torch.float16)[:, None]
    w = (randn(K, seed=seed + 1) * 0.3 + 1.0).half()
    ids = torch.arange(M, dtype=torch.int32, device="cuda")
    out, fold = embedding_fold(h, ids, w)
    assert_equal(out, h, "embedding_fold's rows")
    return h, fold, fold.xg.double() * rstd_ref(fold.part, EPS)[:, None]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,N", [(576, 1536), (4096, 4096), (4096, 12288), (11008, 4096)])
def test_fp16_producer(M, K, N):
    x, W, res = randn(M, K, seed=M), randn(N, K, scale=0.05, seed=K + N), randn(M, N, seed=M + 1)
    fold = FoldOut.new((randn(N, seed=3) * 0.3 + 1.0).half(), M)
    poison(fold.xg, fold.part)
    y = fp16_linear(x, W, residual=res, fold_out=fold)
    assert_equal(y, fp16_linear(x, W, residual=res), f"h M={M} K={K} N={N}")
    check_fold(fold, y, f"M={M} K={K} N={N}")
    early = FoldOut.new(fold.w, M)  # the residual read before the PDL wait: the same bits
    poison(early.xg, early.part)
    assert_equal(fp16_linear(x, W, residual=res, fold_out=early, residual_settled=True), y, f"settled M={M} K={K}")
    assert_equal(early.xg, fold.xg, f"settled xg M={M} K={K} N={N}")
    assert_equal(early.part, fold.part, f"settled part M={M} K={K} N={N}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,N,G", [(1536, 576, 64), (4096, 4096, 128), (11008, 4096, 128), (4096, 4096, 32),
                                   (1024, 12288, 128),  # 768 panels: the 2-warp entry on 132 SMs
                                   (1024, 17600, 128),  # 1,100: the 1-warp entry at 8 rows
                                   (8192, 2048, 128)])  # 128 panels: the 16-warp entry
def test_awq_producer(M, K, N, G):
    p = pack_for_gemv(*awq_tensors(K, N, G, seed=K + N + G))
    x, res = randn(M, K, seed=M), randn(M, N, seed=M + 1)
    fold = FoldOut.new((randn(N, seed=3) * 0.3 + 1.0).half(), M)
    poison(fold.xg, fold.part)
    if not folds(p, M):  # groups of 32 k beyond 8 rows: the variant has no registers left for the fold
        with pytest.raises(ValueError, match="no deferred RMSNorm|GEMV only"):
            awq_linear(x, p, residual=res, fold_out=fold)
        return
    y = awq_linear(x, p, residual=res, fold_out=fold)
    assert_equal(y, awq_linear(x, p, residual=res), f"h M={M} K={K} N={N}")
    check_fold(fold, y, f"M={M} K={K} N={N} G={G}")
    # the residual read before the PDL wait (the engine's settled residual stream): the same bits
    early = FoldOut.new(fold.w, M)
    poison(early.xg, early.part)
    assert_equal(awq_linear(x, p, residual=res, fold_out=early, residual_settled=True), y, f"settled M={M} K={K} N={N}")
    assert_equal(early.xg, fold.xg, f"settled xg M={M} K={K} N={N}")
    assert_equal(early.part, fold.part, f"settled part M={M} K={K} N={N}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,N", [(576, 1536), (4096, 12288), (4096, 32000), (8192, 1024)])
def test_fp16_consumer(M, K, N):
    _, fold, x64 = folded(M, K, seed=M + K)
    W = randn(N, K, scale=0.05, seed=K + N)
    check_consumer(lambda out: fp16_linear(fold.xg, W, out=out, fold_in=fold.consumer(EPS)),
                   fp16_linear_ref(x64, W), f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,N", [(576, 49152), (4096, 32000)])
def test_w8a16_consumer(M, K, N):
    """The int8 lm_head takes the final norm deferred, as the fp16 one does."""
    from model_zoo.quant.int8 import quantize_weight_int8

    _, fold, x64 = folded(M, K, seed=M + K)
    q, s = quantize_weight_int8(randn(N, K, scale=0.05, seed=K + N))
    check_consumer(lambda out: w8a16_linear(fold.xg, q, s, out=out, fold_in=fold.consumer(EPS)),
                   w8a16_linear_ref(x64, q, s), f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,F", [(576, 1536), (4096, 11008)])
def test_fp16_swiglu_consumer(M, K, F):
    _, fold, x64 = folded(M, K, seed=M + F)
    gate, up = randn(F, K, seed=F, scale=0.05), randn(F, K, seed=F + 1, scale=0.05)
    w = interleave_gate_up(torch.cat([gate, up]))  # [2F, K]
    y = fp16_swiglu(fold.xg, w, fold_in=fold.consumer(EPS))
    check_swiglu(y, fp16_linear_ref(x64, gate), fp16_linear_ref(x64, up), fp16_swiglu_ref(x64, w), f"M={M} K={K}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,N,G", [(576, 1536, 64), (4096, 12288, 128), (8192, 1024, 128), (4096, 4096, 32)])
def test_awq_consumer(M, K, N, G):
    _, fold, x64 = folded(M, K, seed=M + N)
    p = pack_for_gemv(*awq_tensors(K, N, G, seed=K + N + G))
    assert folds(p, M) == (M <= 8 or G >= 64)
    if not folds(p, M):
        return  # refused as in test_awq_producer
    check_consumer(lambda out: awq_linear(fold.xg, p, out=out, fold_in=fold.consumer(EPS)),
                   awq_linear_ref(x64, p), f"M={M} K={K} N={N} G={G}")


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("K,F,G", [(576, 1536, 64), (4096, 11008, 128)])
def test_awq_swiglu_consumer(M, K, F, G):
    _, fold, x64 = folded(M, K, seed=M + F)
    qweight, qzeros, scales = awq_tensors(K, 2 * F, G, seed=K + F)
    p = pack_for_gemv(qweight, qzeros, scales, swiglu=True)
    y = awq_linear(fold.xg, p, fold_in=fold.consumer(EPS))
    gu = awq_linear_ref(x64, pack_for_gemv(qweight, qzeros, scales))  # [M, 2F], gate|up not interleaved
    check_swiglu(y, gu[:, :F], gu[:, F:], awq_linear_ref(x64, p), f"M={M} K={K} F={F}")


def test_folded_rows_are_the_rmsnorm_rows():
    """xg * rstd is LlamaRMSNorm's output up to its extra fp16 rounding (norm_fold.py's numerics)."""
    h, fold, x64 = folded(16, 4096, seed=7)
    ref = rmsnorm_ref(h, fold.w, EPS)  # [M, K] fp16, HF roundings
    compare(x64, ref, rtol=2e-3, atol=1e-3 * float(ref.float().abs().max()), what="normalized rows")


@pytest.mark.parametrize("H", [576, 4096])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding_fold(H, id_dtype):
    table = randn(300, H, seed=H)
    ids = torch.tensor([5, 299, -1, 0, 300, 17], dtype=id_dtype, device="cuda")  # -1, 300: out of range
    w = (randn(H, seed=1) * 0.3 + 1.0).half()
    out, fold = embedding_fold(table, ids, w)
    assert_equal(out, embedding(table, ids), "rows")
    check_fold(fold, out, f"H={H}")


def test_fold_is_refused_off_the_gemv():
    K = N = 4096
    p = pack_for_gemv(*awq_tensors(K, N, 128, seed=1))
    x, res = randn(17, K, seed=1), randn(17, N, seed=2)
    fold = FoldOut.new(torch.ones(N, dtype=torch.float16, device="cuda"), 17)
    with pytest.raises(ValueError, match="GEMV only"):
        awq_linear(x, p, residual=res, fold_out=fold)
    with pytest.raises(ValueError, match="GEMV only"):
        fp16_linear(x, randn(N, K, seed=3), residual=res, fold_out=fold)
    with pytest.raises(ValueError, match="adds the residual"):
        awq_linear(x[:4], p, fold_out=FoldOut.new(fold.w, 4))
    with pytest.raises(ValueError, match="H % 64"):
        fp16_linear(randn(2, 64, seed=4), randn(40, 64, seed=5), residual=randn(2, 40, seed=6),
                    fold_out=FoldOut.new(torch.ones(40, dtype=torch.float16, device="cuda"), 2))
