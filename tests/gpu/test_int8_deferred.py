"""The int8 decode path with its quantizations deferred into the GEMVs (int8_gemm.DeferredQuant).

int8_swiglu (the gate|up GEMV with the SwiGLU in its epilogue) must give silu_mul's bits of the int8 GEMM's
output and row maxima that are the rows' maxima; int8_gemm_deferred (the GEMV that quantizes its own input)
must give int8_gemm(*quantize(x))'s bits. Every comparison is assert_equal.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import tuning  # noqa: E402
from kernels_cu.embedding import embedding, embedding_fold  # noqa: E402
from kernels_cu.int8_gemm import (DeferredQuant, NormQuant, int8_gemm, int8_gemm_deferred,  # noqa: E402
                                  int8_gemm_norm, int8_gemm_ref, int8_swiglu, int8_swiglu_norm)
from kernels_cu.norm_fold import INT8_CHANNELS, FoldOut, fold_out_ref, rstd_ref  # noqa: E402
from kernels_cu.quantize import quantize, quantize_fold, quantize_ref  # noqa: E402
from kernels_cu.silu_mul import silu_mul  # noqa: E402

pytestmark = pytest.mark.gpu


def codes(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8).cuda()


def scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 0.02 + 1e-3).cuda()


def chunk_maxima(x: torch.Tensor, C: int) -> torch.Tensor:
    """part [M, C]: max |x| over C uneven slices of each row (as a producer's blocks would write them)."""
    M, K = x.shape
    edges = torch.linspace(0, K, C + 1).round().long().tolist()
    cols = [x[:, a:b].float().abs().amax(dim=1) if b > a else torch.zeros(M, device=x.device)
            for a, b in zip(edges, edges[1:])]
    return torch.stack(cols, dim=1).contiguous()  # [M, C]


@pytest.mark.parametrize("K,N", [(4096, 4096), (11008, 4096), (4096, 40), (64, 4096), (1040, 272)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("residual", [False, True])
def test_deferred_quantization_is_bitwise(M, K, N, residual):
    x = randn(M, K, scale=2.0, seed=K + N + M)
    x[M // 2, K // 3] = -9.5  # a clear row maximum away from the first slice
    if M > 2:
        x[1] = 0.0  # a row of zeros: amax clamped
    qweight, w_scale = codes(N, K, seed=M + 1), scales(N, seed=M + 2) * 0.1
    res = randn(M, N, seed=M + 3) if residual else None
    for C in (1, 32, max(1, K // 8)):
        y = torch.empty(M, N, dtype=torch.float16, device="cuda")
        poison(y)
        int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, C)), qweight, w_scale, residual=res, out=y)
        q, s = quantize_ref(x)
        assert_equal(y, int8_gemm_ref(q, s, qweight, w_scale, residual=res), f"M={M} K={K} N={N} C={C}")


@pytest.mark.parametrize("M", [1, 5])
def test_deferred_static_amax(M):
    K, N = 4096, 512
    x = randn(M, K, scale=2.0, seed=M)
    amax = torch.tensor([3.0], device="cuda")  # below the true max: values clamp to +-127
    qweight, w_scale = codes(N, K, seed=5), scales(N, seed=6) * 0.1
    y = int8_gemm_deferred(DeferredQuant(x, None, amax), qweight, w_scale)
    q, s = quantize_ref(x, amax)
    assert_equal(y, int8_gemm_ref(q, s, qweight, w_scale), f"static M={M}")


@pytest.mark.parametrize("K,N", [(4096, 4096), (11008, 4096), (64, 4096), (1040, 272), (4096, 40)])
@pytest.mark.parametrize("residual", [False, True])
def test_one_row_quantized_in_the_loop_equals_the_prologue(K, N, residual):
    """int8_gemv_xq1 (one row, quantized tile by tile in the main loop) against int8_gemv_xq (the whole row in a
    prologue) and the reference: the same bits, with the max from partials (C = 1, 32, K / 8, more than a warp's
    lanes), from row_amax and static (below the row's max: codes clamp), and the next norm's fold outputs."""

    x = randn(1, K, scale=3.0, seed=K + N)
    x[0, K - 1] = -11.0  # the max in the last tile: the loop reaches it last
    x[0, 5] = 1e-4       # a code that rounds to 0
    qweight, w_scale = codes(N, K, seed=K), scales(N, seed=N) * 0.1
    res = randn(1, N, seed=K + 1) if residual else None
    amax = x.float().abs().amax(dim=1)
    inputs = [DeferredQuant(x, chunk_maxima(x, C)) for C in (1, 32, 40, max(1, K // 8))]
    unread = torch.empty(1, 7, device="cuda")
    poison(unread)  # partials the GEMV must not read when it has the row max
    inputs += [DeferredQuant(x, unread, row_amax=amax),
               DeferredQuant(x, None, torch.tensor([2.5], device="cuda"))]
    for i, xq in enumerate(inputs):
        got = {}
        for loop in (True, False):
            fold = FoldOut.new(norm_weight(N, 3), 1, int8=True) if residual and N % 64 == 0 else None
            with tuning.override(xq_row_loop=loop):
                y = int8_gemm_deferred(xq, qweight, w_scale, residual=res, fold_out=fold)
            got[loop] = (y, fold)
        what = f"K={K} N={N} input {i}"
        assert_equal(got[True][0], got[False][0], what)
        if got[True][1] is not None:
            for name in ("xg", "mx", "part"):
                assert_equal(getattr(got[True][1], name), getattr(got[False][1], name), f"{what}: fold {name}")
        q, s = quantize_ref(x, xq.static_amax)
        assert_equal(got[True][0], int8_gemm_ref(q, s, qweight, w_scale, residual=res), f"{what}: reference")


@pytest.mark.parametrize("K,N", [(4096, 4096), (1040, 272), (4096, 40), (2048, 8200)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_settled_residual(M, K, N):
    """residual_settled: each epilogue thread reads its residual before the PDL wait; the same bits as reading it
    after (y and the next norm's fold outputs), in the row loop and the prologue entries."""
    x = randn(M, K, scale=2.0, seed=M + K)
    qweight, w_scale = codes(N, K, seed=N), scales(N, seed=K) * 0.1
    res = randn(M, N, seed=N + 3)
    xq = DeferredQuant(x, chunk_maxima(x, 32))
    for loop in ((True, False) if M == 1 else (False,)):
        got = []
        for settled in (False, True):
            fold = FoldOut.new(norm_weight(N, 5), M, int8=True) if N % 64 == 0 else None
            with tuning.override(xq_row_loop=loop):
                y = int8_gemm_deferred(xq, qweight, w_scale, residual=res, fold_out=fold, residual_settled=settled)
            got.append((y, fold))
        what = f"M={M} K={K} N={N} loop={loop}"
        assert_equal(got[1][0], got[0][0], what)
        if fold is not None:
            for name in ("xg", "mx", "part"):
                assert_equal(getattr(got[1][1], name), getattr(got[0][1], name), f"{what}: fold {name}")


def test_deferred_beyond_the_kernel_rows_quantizes_first():
    M, K, N = 12, 1024, 256
    x = randn(M, K, seed=9)
    qweight, w_scale = codes(N, K, seed=10), scales(N, seed=11)
    y = int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, 4)), qweight, w_scale)
    assert_equal(y, int8_gemm(*quantize(x), qweight, w_scale), "12 rows")


@pytest.mark.parametrize("F,K", [(11008, 4096), (1536, 576), (8, 64), (688, 1040)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
def test_swiglu_epilogue_is_silu_mul_of_the_gemv(M, F, K):
    q_x, qweight = codes(M, K, seed=F + M), codes(2 * F, K, seed=F + 1)
    a_scale, w_scale = scales(M, seed=3) * 0.1, scales(2 * F, seed=4) * 0.1
    got = int8_swiglu(q_x, a_scale, qweight, w_scale)
    gate_up = int8_gemm(q_x, a_scale, qweight, w_scale)  # [M, 2F]: gate columns, then up
    want = silu_mul(gate_up)
    assert_equal(got.x, want, f"M={M} F={F} K={K}")
    assert got.part.shape == (M, F // 8)
    assert_equal(got.part, want.float().abs().reshape(M, F // 8, 8).amax(dim=2), "block maxima")


def test_swiglu_then_deferred_down_equals_the_quantized_chain():
    """The decode chain gate|up -> SwiGLU -> down as the engine runs it at one row, against the chain with
    silu_mul_quant: the same bits."""
    from kernels_cu.silu_mul import silu_mul_quant

    M, F, K = 1, 11008, 4096
    q_x, wgu = codes(M, K, seed=1), codes(2 * F, K, seed=2)
    a_scale, sgu = scales(M, seed=3) * 0.05, scales(2 * F, seed=4) * 0.05
    wd, sd = codes(K, F, seed=5), scales(K, seed=6) * 0.05
    h = randn(M, K, seed=7)
    got = int8_gemm_deferred(int8_swiglu(q_x, a_scale, wgu, sgu), wd, sd, residual=h)
    want = int8_gemm(*silu_mul_quant(int8_gemm(q_x, a_scale, wgu, sgu)), wd, sd, residual=h)
    assert_equal(got, want, "gate|up -> down")


@pytest.mark.parametrize("M,F,K", [(1, 11008, 4096), (3, 688, 1040), (8, 8, 64)])
def test_swiglu_row_amax_is_each_rows_max(M, F, K):
    """int8_swiglu with row_amax: the atomic max of the blocks' values is the max of part, bit for bit, the
    SwiGLU output unchanged; the buffer must be zero before, and a second call on it (cleared by quantize_fold's
    `zero`, as the engine runs it) is exact again with smaller values."""
    q_x, qweight = codes(M, K, seed=F + M), codes(2 * F, K, seed=F + 2)
    a_scale, w_scale = scales(M, seed=5) * 0.1, scales(2 * F, seed=6) * 0.1
    row_amax = torch.zeros(M, dtype=torch.float32, device="cuda")
    for trial, shrink in enumerate((1.0, 0.25)):
        if trial:  # the engine's order: the quantize_fold before gate|up clears it
            xg = randn(M, 64, seed=trial)
            quantize_fold(xg, xg.float().abs().reshape(M, 8, 8).amax(-1).contiguous(), None, 0.0, zero=row_amax)
            assert_equal(row_amax, torch.zeros_like(row_amax), "cleared by quantize_fold")
        d = int8_swiglu(q_x, a_scale * shrink, qweight, w_scale, row_amax=row_amax)
        assert d.row_amax is row_amax
        assert_equal(d.x, int8_swiglu(q_x, a_scale * shrink, qweight, w_scale).x, f"y M={M} F={F} trial {trial}")
        assert_equal(row_amax, d.part.amax(dim=1), f"row max M={M} F={F} trial {trial}")


def test_swiglu_row_amax_then_deferred_down_equals_the_quantized_chain():
    """The engine's one-row chain with the row max read instead of the 1,376 partials: the same bits."""
    from kernels_cu.silu_mul import silu_mul_quant

    M, F, K = 1, 11008, 4096
    q_x, wgu = codes(M, K, seed=11), codes(2 * F, K, seed=12)
    a_scale, sgu = scales(M, seed=13) * 0.05, scales(2 * F, seed=14) * 0.05
    wd, sd = codes(K, F, seed=15), scales(K, seed=16) * 0.05
    h = randn(M, K, seed=17)
    row_amax = torch.zeros(M, dtype=torch.float32, device="cuda")
    d = int8_swiglu(q_x, a_scale, wgu, sgu, row_amax=row_amax)
    poison(d.part)  # the GEMV must not need them
    got = int8_gemm_deferred(d, wd, sd, residual=h)
    want = int8_gemm(*silu_mul_quant(int8_gemm(q_x, a_scale, wgu, sgu)), wd, sd, residual=h)
    assert_equal(got, want, "gate|up -> down with the row max")


# ---- the deferred RMSNorm of an int8 decode step (norm_fold.py): o_proj / down_proj write xg, sums and maxima,
# quantize_fold quantizes xg for the next GEMV
EPS = 1e-5


def norm_weight(n: int, seed: int) -> torch.Tensor:
    return (randn(n, seed=seed) * 0.3 + 1.0).half()


def check_int8_fold(fold: FoldOut, h: torch.Tensor, what: str) -> None:
    """What an int8 producer writes for the next norm: xg torch's fp16 h * w, the maxima of |xg| per 8 channels
    exact, the sums of h^2 per 8 channels within fp32 summation error."""
    M, N = h.shape
    xg, part = fold_out_ref(h, fold.w, INT8_CHANNELS)
    assert_equal(fold.xg, xg, f"{what}: xg")
    assert_equal(fold.mx, xg.float().abs().reshape(M, N // 8, 8).amax(-1), f"{what}: maxima of |xg|")
    compare(fold.part, part, rtol=1e-5, atol=1e-6 * float(part.abs().max()), what=f"{what}: sums of h^2")


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("K,N", [(4096, 4096), (11008, 4096), (4096, 12288), (512, 1088)])
def test_int8_producer_writes_the_deferred_norm(M, K, N):
    """o_proj / down_proj with fold_out: h bit for bit the GEMV without it, xg torch's fp16 h * w, the maxima of
    |xg| per 8 channels exact, the sums of h^2 per 8 channels within fp32 summation error."""
    x = randn(M, K, scale=2.0, seed=K + M)
    xq = DeferredQuant(x, chunk_maxima(x, 16))
    qweight, w_scale, res = codes(N, K, seed=M + 1), scales(N, seed=M + 2) * 0.1, randn(M, N, seed=M + 3)
    fold = FoldOut.new(norm_weight(N, seed=N), M, int8=True)
    poison(fold.xg, fold.part, fold.mx)
    y = int8_gemm_deferred(xq, qweight, w_scale, residual=res, fold_out=fold)
    assert_equal(y, int8_gemm_deferred(xq, qweight, w_scale, residual=res), f"h M={M} K={K} N={N}")
    check_int8_fold(fold, y, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [1, 4, 8, 9, 16])
def test_int8_gemv_writes_the_deferred_norm(M):
    """The decode GEMV with its residual (o_proj / down_proj beyond one row, or without the deferred quantization)
    and fold_out: h bit for bit without it, xg, maxima and sums as above."""
    K, N = 4096, 4096
    q_x, qweight = codes(M, K, seed=M), codes(N, K, seed=M + 1)
    a_scale, w_scale, res = scales(M, seed=M + 2) * 0.1, scales(N, seed=M + 3) * 0.1, randn(M, N, seed=M + 4)
    fold = FoldOut.new(norm_weight(N, seed=N), M, int8=True)
    poison(fold.xg, fold.part, fold.mx)
    y = int8_gemm(q_x, a_scale, qweight, w_scale, residual=res, fold_out=fold)
    assert_equal(y, int8_gemm(q_x, a_scale, qweight, w_scale, residual=res), f"h M={M}")
    check_int8_fold(fold, y, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("H", [576, 4096])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_embedding_writes_the_int8_deferred_norm(H, id_dtype):
    """embedding_fold(int8=True), layer 0's producer: the rows exact (zero for ids out of range), xg torch's fp16
    h * w, the maxima of |xg| per 8 channels exact, the sums of h^2 per 8 channels within fp32 summation error."""
    table = randn(300, H, scale=2.0, seed=H)
    ids = torch.tensor([5, 299, -1, 0, 300, 17], dtype=id_dtype, device="cuda")  # -1, 300: out of range
    out, fold = embedding_fold(table, ids, norm_weight(H, seed=H), int8=True)
    T = ids.shape[0]
    assert fold.int8 and fold.part.shape == fold.mx.shape == (T, H // INT8_CHANNELS)
    assert_equal(out, embedding(table, ids), "rows")
    check_int8_fold(fold, out, f"H={H}")


@pytest.mark.parametrize("T,K", [(1, 4096), (1, 11008), (3, 576), (8, 4096), (2, 1032)])
def test_quantize_fold(T, K):
    """Dynamic: quantize()'s codes of xg (rstd cancels) with a_scale times rstd; static: the codes of rstd * xg by
    the static amax (one code off at most, where fp32 rsqrt and float64 round a near-tie apart)."""
    h = randn(T, K, seed=K + T) * torch.linspace(0.05, 4.0, T, device="cuda", dtype=torch.float16)[:, None]
    if T > 2:
        h[1] = 0.0  # a row of zeros: amax clamped, rstd = 1 / sqrt(eps)
    xg, part = fold_out_ref(h, norm_weight(K, seed=T), INT8_CHANNELS)
    mx = xg.float().abs().reshape(T, K // 8, 8).amax(-1).contiguous()  # [T, K / 8]
    sq = part.float().contiguous()
    rstd = rstd_ref(part, EPS, INT8_CHANNELS)  # [T] float64
    q, s = quantize_fold(xg, mx, sq, EPS)
    q_ref, s_ref = quantize_ref(xg)
    assert_equal(q, q_ref, f"dynamic codes T={T} K={K}")
    compare(s, s_ref.double() * rstd, rtol=4e-6, what="a_scale")
    amax = torch.tensor([1.5], device="cuda")
    q, s = quantize_fold(xg, mx, sq, EPS, amax)
    want = torch.clamp(torch.round(xg.double() * rstd[:, None] * (127 / 1.5)), -127, 127)
    assert int((q.double() - want).abs().max()) <= 1 and float((q.double() != want).float().mean()) < 1e-3
    assert_equal(s, torch.full((T,), 1.5 / 127, device="cuda"), "static a_scale")


@pytest.mark.parametrize("M,F,K", [(2, 11008, 4096), (8, 1536, 576), (16, 688, 1040), (5, 8, 64)])
def test_swiglu_then_quantize_fold_equals_silu_mul_quant(M, F, K):
    """A decode step of 2-16 rows: the gate|up GEMV with the SwiGLU epilogue, then quantize_fold from its
    maxima per 8 channels (no norm), against the GEMV, then silu_mul_quant: the same codes and scales, dynamic
    and static."""
    from kernels_cu.silu_mul import silu_mul_quant

    q_x, qweight = codes(M, K, seed=F + M), codes(2 * F, K, seed=F + 1)
    a_scale, w_scale = scales(M, seed=3) * 0.1, scales(2 * F, seed=4) * 0.1
    d = int8_swiglu(q_x, a_scale, qweight, w_scale)
    gate_up = int8_gemm(q_x, a_scale, qweight, w_scale)
    for amax in (None, torch.tensor([0.05], device="cuda")):
        got = quantize_fold(d.x, d.part, None, 0.0, amax)
        want = silu_mul_quant(gate_up, amax)
        assert_equal(got[0], want[0], f"codes M={M} F={F} static={amax is not None}")
        assert_equal(got[1], want[1], f"a_scale M={M} F={F}")


def test_int8_fold_chain_matches_the_rmsnorm_kernel():
    """down_proj writing the deferred norm -> quantize_fold -> q|k|v, as the engine runs it at one row, against
    down_proj -> rmsnorm_quant -> q|k|v: the same product up to the one fp16 rounding the fold drops (some codes
    move by one), both near the float64 product of the normalized row."""
    from kernels_cu.rmsnorm import rmsnorm_quant

    K, H, N = 11008, 4096, 12288
    a = randn(1, K, seed=1)
    xq = DeferredQuant(a, chunk_maxima(a, K // 8))
    wd, sd, h0 = codes(H, K, seed=2), scales(H, seed=3) * 0.02, randn(1, H, seed=4)
    wq, sq = codes(N, H, seed=5), scales(N, seed=6) * 0.05
    norm = norm_weight(H, seed=7)
    fold = FoldOut.new(norm, 1, int8=True)
    h = int8_gemm_deferred(xq, wd, sd, residual=h0, fold_out=fold)
    got = int8_gemm(*quantize_fold(fold.xg, fold.mx, fold.part, EPS), wq, sq)
    want = int8_gemm(*rmsnorm_quant(h, norm, EPS), wq, sq)
    hd = h.double()
    x = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()  # [1, H] the norm in float64
    exact = x @ (wq.double() * sq.double()[:, None]).T  # [1, N]

    def err(y):
        return float((y.double() - exact).norm() / exact.norm())

    assert err(got) < 1.25 * err(want), (err(got), err(want))
    assert err(got) < 2e-2  # per-token int8 codes of a 4096-wide row: ~1% of the product


@pytest.mark.parametrize("K,N", [(4096, 12288), (4096, 40), (64, 4096), (1040, 272), (11008, 64)])
@pytest.mark.parametrize("mode", ["dynamic", "static", "no-norm"])
def test_one_row_norm_quantized_in_the_gemv_equals_quantize_fold(K, N, mode):
    """int8_gemv_nq1 / _nq1_silu (a deferred RMSNorm of one row quantized in the GEMV's main loop from the
    producer's partials) against quantize_fold then the GEMV: the same bits, for C = K / 8 and other counts (the
    sums in quantize_fold's order: more than 128 partials wrap its threads), and the `zero` buffer cleared."""
    xg = randn(1, K, scale=2.5, seed=K + N)
    xg[0, K - 2] = 13.0  # the max in the last tile
    h = randn(1, K, seed=K) * 4.0
    qweight, w_scale = codes(N, K, seed=N), scales(N, seed=K) * 0.1
    static = torch.tensor([1.5], device="cuda") if mode == "static" else None
    for C in sorted({1, 40, 200, 513, K // 8}):
        if C > K:
            continue
        mx = chunk_maxima(xg, C)
        sq = None if mode == "no-norm" else chunk_maxima(h, C) ** 2 * 3.0 + 0.01  # any positive sums
        zero = torch.full((1,), 7.0, device="cuda")
        nq = NormQuant(xg, mx, sq, EPS, static, zero)
        assert nq.in_loop()
        y = int8_gemm_norm(nq, qweight, w_scale)
        assert_equal(zero, torch.zeros_like(zero), f"K={K} C={C}: zero cleared")
        q, s = quantize_fold(xg, mx, sq, EPS, static)
        assert_equal(y, int8_gemm(q, s, qweight, w_scale), f"{mode} K={K} N={N} C={C}")
        if N % 16 == 0:
            row_amax = torch.zeros(1, device="cuda")
            d = int8_swiglu_norm(NormQuant(xg, mx, sq, EPS, static), qweight, w_scale, row_amax)
            want = int8_swiglu(q, s, qweight, w_scale)
            assert_equal(d.x, want.x, f"swiglu {mode} K={K} C={C}")
            assert_equal(d.part, want.part, f"swiglu maxima {mode} K={K} C={C}")
            assert_equal(row_amax, want.part.amax(dim=1), f"swiglu row max {mode} K={K} C={C}")


def test_norm_quant_beyond_one_row_runs_quantize_fold():
    """Two rows, or tuning.norm_row_loop off: quantize_fold first, the same bits; the SwiGLU GEMV refuses to clear the row
    max it accumulates."""

    K, N = 1024, 256
    xg, h = randn(2, K, seed=1), randn(2, K, seed=2)
    mx, sq = chunk_maxima(xg, K // 8), chunk_maxima(h, K // 8) ** 2
    qweight, w_scale = codes(N, K, seed=3), scales(N, seed=4)
    nq = NormQuant(xg, mx, sq, EPS)
    assert not nq.in_loop()
    assert_equal(int8_gemm_norm(nq, qweight, w_scale), int8_gemm(*quantize_fold(xg, mx, sq, EPS), qweight, w_scale),
                 "two rows")
    one = NormQuant(xg[:1], mx[:1], sq[:1], EPS)
    want = int8_gemm_norm(one, qweight, w_scale)
    with tuning.override(norm_row_loop=False):
        assert not one.in_loop()
        assert_equal(int8_gemm_norm(one, qweight, w_scale), want, "switched off")
    buf = torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match="cannot clear"):
        int8_swiglu_norm(NormQuant(xg[:1], mx[:1], sq[:1], EPS, zero=buf), qweight, w_scale, row_amax=buf)


def test_int8_fold_rejects_bad_inputs():
    x = randn(2, 64, seed=1)
    qweight, w_scale, res = codes(64, 64, seed=2), scales(64, seed=3), randn(2, 64, seed=4)
    xq = DeferredQuant(x, chunk_maxima(x, 8))
    with pytest.raises(ValueError, match="with its residual"):
        int8_gemm_deferred(xq, qweight, w_scale, fold_out=FoldOut.new(norm_weight(64, 5), 2, int8=True))
    with pytest.raises(ValueError, match="at most 16 rows"):
        int8_gemm(codes(17, 64, seed=6), scales(17, seed=7), qweight, w_scale, residual=randn(17, 64, seed=8),
                  fold_out=FoldOut.new(norm_weight(64, 5), 17, int8=True))
    with pytest.raises(ValueError, match="int8"):
        int8_gemm_deferred(xq, qweight, w_scale, residual=res, fold_out=FoldOut.new(norm_weight(64, 5), 2))
    with pytest.raises(ValueError, match="sq must have shape"):
        quantize_fold(x, torch.zeros(2, 4, device="cuda"), torch.zeros(2, 8, device="cuda"), EPS)
    with pytest.raises(ValueError, match="mx must be"):
        quantize_fold(x, torch.zeros(3, 8, device="cuda"), torch.zeros(3, 8, device="cuda"), EPS)


def test_deferred_rejects_bad_inputs():
    x = randn(2, 64, seed=1)
    qweight, w_scale = codes(32, 64, seed=2), scales(32, seed=3)
    with pytest.raises(ValueError, match="partial maxima or a static amax"):
        int8_gemm_deferred(DeferredQuant(x, None), qweight, w_scale)
    with pytest.raises(ValueError, match="part must be"):
        int8_gemm_deferred(DeferredQuant(x, torch.zeros(3, 4, device="cuda")), qweight, w_scale)
    with pytest.raises(ValueError, match="K=64"):
        int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, 2)), codes(32, 48, seed=4), w_scale)
    with pytest.raises(ValueError, match="at most 16 rows"):
        int8_swiglu(codes(17, 64, seed=5), scales(17, seed=6), codes(32, 64, seed=7), scales(32, seed=8))
