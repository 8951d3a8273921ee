"""The FP8 E4M3 kernels against their torch references and model_zoo/quant/fp8.py's contract.

fp8_quantize: codes and scales bit for bit (the reference's and model_zoo's). fp8_gemv / fp8_wgmma: the fp32 sums of
exact e4m3 products differ from the float64 reference only in summation order, so the fp16 outputs must be within
2e-3 (relative, and of the rms) of it and 1e-3 relative in norm (conftest.check_gemm); rows and columns the kernel
must not write stay poisoned.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, check_gemm, check_swiglu, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, fp8_wgmma, tuning  # noqa: E402
from kernels_cu.fp8_gemm import (XQ_SIGNATURE, fp8_gemm, fp8_gemm_ref, fp8_linear,  # noqa: E402
                                 fp8_linear_ref, fp8_swiglu, fp8_swiglu_ref)
from kernels_cu.fp8_quantize import FP8, fp8_quantize, fp8_quantize_ref, has_fp8  # noqa: E402
from kernels_cu.fp8_wgmma import VARIANTS  # noqa: E402
from kernels_cu.gemm_shapes import cdiv  # noqa: E402
from kernels_cu.swiglu_layout import gate_up_order  # noqa: E402
from model_zoo.quant import fp8 as contract  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8(torch.cuda.current_device())),
    reason="FP8 E4M3 needs compute capability 8.9 or newer")]
HOPPER = torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())
needs_wgmma = pytest.mark.skipif(not HOPPER, reason="wgmma needs an sm_90 GPU")

KN = [(576, 1536), (1536, 576), (4096, 4096), (4096, 12288), (11008, 4096), (8192, 8192), (48, 37), (4112, 264)]
NAN8 = 0x7F  # an e4m3fn NaN: the quantizer never writes it for finite inputs


def weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-channel scales of a random weight, by model_zoo's quantizer: (w8 e4m3 [N, K], w_scale [N])."""
    w8, w_scale = contract.quantize_weight_fp8(randn(N, K, scale=0.05, seed=seed).float())
    return w8.contiguous(), w_scale.contiguous()


def acts(M: int, K: int, seed: int, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of random activations with a few outlier channels (the spread e4m3 must cover)."""
    x = randn(M, K, seed=seed)
    x[:, ::97] *= 20
    return fp8_quantize_ref(x, 0.05 if static else None)


# -- fp8_quantize ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K", [8, 576, 1000, 4096, 11008, 28672])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_bitwise(T, K, static):
    x = randn(T, K, seed=T + K, scale=3.0)
    x[0, :3] = torch.tensor([1e4, -6e4, 1e-6], dtype=torch.float16)  # saturating, and below e4m3's subnormals
    if T > 1:
        x[1] = 0  # an all-zero row: the 1e-8 floor
    scale = torch.tensor([0.02], device="cuda") if static else None
    x8, a_scale = torch.empty(T, K, dtype=FP8, device="cuda"), torch.empty(T, device="cuda")
    x8.view(torch.uint8).fill_(NAN8)
    poison(a_scale)
    fp8_quantize(x, scale, x8=x8, a_scale=a_scale)
    want8, want_s = fp8_quantize_ref(x, scale)
    assert_equal(x8.view(torch.uint8), want8.view(torch.uint8), f"codes T={T} K={K}")
    assert_equal(a_scale, want_s, f"scales T={T} K={K}")
    # model_zoo's contract on the CPU (true division there) gives the same bits
    cpu8, cpu_s = (contract.quantize_act_fp8(x.cpu(), 0.02) if static
                   else contract.quantize_act_fp8_per_token(x.cpu()))
    assert_equal(x8.view(torch.uint8).cpu(), cpu8.view(torch.uint8), f"contract codes T={T} K={K}")
    assert_equal(a_scale.cpu(), cpu_s.float(), f"contract scales T={T} K={K}")


# -- the decode GEMV ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K,N", KN)
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16, 17, 32, 33, 64])
def test_gemv(M, K, N):
    """Up to 16 rows blocks of 8 or 16 token rows, above them of 32 (fp8_gemv_mt4: one block a panel at 17-32)."""
    x8, a_scale = acts(M, K, seed=M)
    w8, w_scale = weight(N, K, seed=K + N)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    fp8_gemm(x8, a_scale, w8, w_scale, out=y, wgmma=False)
    want = fp8_gemm_ref(x8, a_scale, w8, w_scale)
    check_gemm(y, want, f"M={M} K={K} N={N}")
    # model_zoo's fp32 contract, as the CPU reference computes it
    check_gemm(y, contract.fp8_gemm_ref(x8, w8, a_scale, w_scale, torch.float16), f"contract M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [17, 32, 33, 64])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_alu_weight_conversion_is_bitwise_the_cvt_one(M, epi):
    """fp8_gemv_mt4a converts the weights by integer ops to their values times 2^-8 (every code: subnormals, both
    zeros, saturating 448) and unscales the sums: fp8_gemv_mt4's output bit for bit. The 32-row blocks against the
    16-row ones: both within the reference's bound."""
    from kernels_cu import tuning

    K, N = 4112, 1040
    x8, a_scale = acts(M, K, seed=M + 50)
    g = torch.Generator().manual_seed(M)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (the quantizer never writes them)
    w8, w_scale = codes.cuda().view(FP8), torch.rand(N, device="cuda") * 1e-3 + 1e-4
    r = randn(M, N, seed=M + 51) if epi == "res" else None

    def run():
        if epi == "silu":
            return fp8_swiglu(x8, a_scale, w8, w_scale, wgmma=False)
        return fp8_gemm(x8, a_scale, w8, w_scale, residual=r, wgmma=False)

    with tuning.override(fp8_gemv_alu_weights=False):
        cvt = run()
    with tuning.override(fp8_gemv_alu_weights=True):
        alu = run()
    assert_equal(alu, cvt, f"mt4a M={M} {epi}")
    if epi != "silu":
        with tuning.override(fp8_gemv_block_rows=16):
            check_gemm(run(), fp8_gemm_ref(x8, a_scale, w8, w_scale, r), f"mt2 M={M}")
        check_gemm(cvt, fp8_gemm_ref(x8, a_scale, w8, w_scale, r), f"mt4 M={M}")


@pytest.mark.parametrize("M", [1, 5, 8, 9, 17, 33, 64])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_gemv_on_the_codes_fp16_values(M, epi):
    """x given as the codes' exact fp16 values (fp8_gemv_h1 / h2: the weights alone converted in the loop): the
    same products as on the codes, within the reference's bound."""
    K, N = 4112, 1040
    x8, a_scale = acts(M, K, seed=M + 70)
    w8, w_scale = weight(N, K, seed=M + 71)
    xh = x8.to(torch.float16)  # [M, K] exact
    if epi == "silu":
        F = N // 2
        y = torch.empty(M, F, dtype=torch.float16, device="cuda")
        poison(y)
        fp8_swiglu(xh, a_scale, w8, w_scale, out=y)
        assert rel_err(y, fp8_swiglu_ref(x8, a_scale, w8, w_scale)) < 2e-3, f"h silu M={M}"
        return
    r = randn(M, N, seed=M + 72) if epi == "res" else None
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    fp8_gemm(xh, a_scale, w8, w_scale, residual=r, out=y)
    check_gemm(y, fp8_gemm_ref(x8, a_scale, w8, w_scale, r), f"h M={M} {epi}")


@pytest.mark.parametrize("M", [1, 5, 16, 40])
@pytest.mark.parametrize("static", [False, True])
def test_gemv_residual_and_static_scale(M, static):
    K, N = 4096, 11008
    x8, a_scale = acts(M, K, seed=M + 1, static=static)
    if static:
        a_scale = a_scale[:1].contiguous()  # one scale for the tensor (a_stride 0)
    w8, w_scale = weight(N, K, seed=3)
    r = randn(M, N, seed=M + 9)
    y = fp8_gemm(x8, a_scale, w8, w_scale, residual=r, wgmma=False)
    check_gemm(y, fp8_gemm_ref(x8, a_scale, w8, w_scale, residual=r), f"residual M={M} static={static}")


def swiglu_case(M: int, K: int, F: int, seed: int):
    """(x8, a_scale, interleaved w8 and w_scale, reference output, reference gate and up products)."""
    x8, a_scale = acts(M, K, seed=seed)
    w8, w_scale = weight(2 * F, K, seed=seed + 1)
    order = gate_up_order(2 * F, "cuda")
    wi8, wis = w8.view(torch.uint8)[order].view(FP8).contiguous(), w_scale[order].contiguous()
    gate = fp8_gemm_ref(x8, a_scale, w8[:F], w_scale[:F])
    up = fp8_gemm_ref(x8, a_scale, w8[F:], w_scale[F:])
    return x8, a_scale, wi8, wis, fp8_swiglu_ref(x8, a_scale, wi8, wis), gate, up


@pytest.mark.parametrize("K,F", [(576, 1536), (4096, 11008), (256, 40)])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 64])
def test_gemv_swiglu_epilogue(M, K, F):
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=M + F)
    y = torch.empty(M, F, dtype=torch.float16, device="cuda")
    poison(y)
    fp8_swiglu(x8, a_scale, w8, w_scale, out=y, wgmma=False)
    check_swiglu(y, gate, up, want, f"swiglu M={M} K={K} F={F}")


@pytest.mark.parametrize("kind,epi", [(k, e) for k in ("mt1", "mt2", "mt4", "mt4a", "h1", "h2", "xq", "xq1")
                                      for e in ("", "_res", "_silu")]
                         + [(k, e) for k in ("nq", "nq1") for e in ("", "_silu")]
                         + [("dq1", ""), ("dq1", "_res"), ("fq1", ""), ("fq1", "_silu")])
def test_gemv_resources(kind, epi):
    """No variant spills (mt4: at most two loop-invariant words, at the 128-register cap that keeps two blocks a SM);
    registers and the ring leave two resident blocks a SM (three at one token tile)."""
    from kernels_cu.fp8_gemm import DQ_SIGNATURE, FQ_SIGNATURE, GEMV_SIGNATURE, NQ_SIGNATURE
    from kernels_cu.gemm_shapes import GEMV_RING_BYTES, smem_per_sm

    sig = {"xq": XQ_SIGNATURE, "nq": NQ_SIGNATURE, "dq": DQ_SIGNATURE, "fq": FQ_SIGNATURE}.get(kind.rstrip("1"),
                                                                                                 GEMV_SIGNATURE)
    res = build.get_function("fp8_gemm.cu", f"fp8_gemv_{kind}{epi}", sig).resources()
    assert res["local_bytes"] <= (8 if kind.startswith("mt4") else 0), res
    blocks = 2 if kind in ("mt2", "mt4", "mt4a", "h2") else 3
    assert cdiv(res["registers"], 8) * 8 * 256 * blocks <= 65536, res
    assert blocks * (GEMV_RING_BYTES + res["shared_bytes"] + 1024) <= smem_per_sm(torch.cuda.current_device())


@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("static", [False, True])
def test_self_quantizing_gemv_is_quantize_then_gemv_bitwise(M, epi, static):
    """fp8_gemv_xq finds each row's scale and quantizes in its main loop: fp8_quantize + fp8_gemv's bits (against
    the GEMV's blocks of up to 16 rows, whose warps split K as xq's do; 32-row blocks sum in other steps)."""
    from kernels_cu import tuning

    K, N = (4096, 2 * 1536) if epi == "silu" else (11008, 4096)
    x = randn(M, K, seed=M + 40, scale=2.0)
    x[:, ::97] *= 20
    w8, w_scale = weight(N, K, seed=N + 1)
    scale = torch.tensor([0.05], device="cuda") if static else None
    r = randn(M, N, seed=M + 41) if epi == "res" else None
    got = fp8_linear(x, w8, w_scale, scale, residual=r, swiglu=epi == "silu", xq=True)
    with tuning.override(fp8_gemv_block_rows=16):
        want = fp8_linear(x, w8, w_scale, scale, residual=r, swiglu=epi == "silu", xq=False)
    assert_equal(got, want, f"xq M={M} {epi} static={static}")


@pytest.mark.parametrize("K", [48, 1040, 4112])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
@pytest.mark.parametrize("static", [False, True])
def test_one_row_gemv_is_quantize_then_gemv_bitwise(K, epi, static):
    """One row runs fp8_gemv_xq1 (the warp shares the row's quantization, lane (g, t) a pair of each tile, gathered
    by shuffles): fp8_quantize + fp8_gemv's bits, also at K's that end in a partial tile or step."""
    N = 2 * 528 if epi == "silu" else 1040
    x = randn(1, K, seed=K + 3, scale=2.0)
    x[:, ::97] *= 20
    w8, w_scale = weight(N, K, seed=N + K)
    scale = torch.tensor([0.05], device="cuda") if static else None
    r = randn(1, N, seed=K + 4) if epi == "res" else None
    got = fp8_linear(x, w8, w_scale, scale, residual=r, swiglu=epi == "silu", xq=True)
    want = fp8_linear(x, w8, w_scale, scale, residual=r, swiglu=epi == "silu", xq=False)
    assert_equal(got, want, f"xq1 K={K} {epi} static={static}")


@pytest.mark.parametrize("K", [576, 2064, 4096, 8192])
@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("static,swiglu", [(False, False), (True, False), (False, True)])
def test_norm_gemv_is_rmsnorm_quantize_gemv_bitwise(M, K, static, swiglu):
    """fp8_gemv_nq applies the RMSNorm itself (its sums in rmsnorm.cu's order, emulated for the norm kernel's
    thread count: 96, 160, 256 threads at these K): rmsnorm + fp8_quantize + fp8_gemv's bits (M 1: fp8_gemv_nq1)."""
    from kernels_cu.fp8_gemm import NormIn, fp8_linear_norm, fp8_linear_norm_ref
    from kernels_cu.rmsnorm import rmsnorm

    h = randn(M, K, seed=M + K, scale=3.0)
    h[:, ::97] *= 10
    nw = (1 + 0.1 * randn(K, seed=K + 1).float()).half()
    N = 2 * 1040 if swiglu else 1040
    w8, w_scale = weight(N, K, seed=N + K)
    scale = torch.tensor([0.02], device="cuda") if static else None
    x = NormIn(h, nw, 1e-5)
    got = fp8_linear_norm(x, w8, w_scale, scale, swiglu=swiglu)
    want = fp8_linear(rmsnorm(h, nw, 1e-5), w8, w_scale, scale, swiglu=swiglu, xq=False)
    assert_equal(got, want, f"nq M={M} K={K} static={static} swiglu={swiglu}")
    if not swiglu:  # and the float64 reference, to the GEMMs' tolerance (one code may flip against it: 3e-2)
        ref = fp8_linear_norm_ref(x, w8, w_scale, scale)
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 3e-2


# -- the one-row deferred chain (fp8_gemv_dq1 / fp8_gemv_fq1, int8's deferred_quant.cuh) ------------------------

def fold_inputs(h: torch.Tensor, nw: torch.Tensor):
    """What an Int8Fold producer writes for the norm after it: xg = h * w, and per 8 channels max |xg| and sum h^2."""
    M, K = h.shape
    xg = h * nw  # [M, K] fp16
    mx = xg.float().abs().reshape(M, K // 8, 8).amax(-1)  # [M, K / 8]
    sq = h.float().pow(2).reshape(M, K // 8, 8).sum(-1)  # [M, K / 8]
    return xg, mx, sq


@pytest.mark.parametrize("K", [48, 1040, 4112, 11008])
@pytest.mark.parametrize("source", ["part", "row_amax", "static"])
@pytest.mark.parametrize("epi", ["plain", "res", "fold"])
def test_deferred_row_gemv_is_quantize_then_gemv_bitwise(K, source, epi):
    """fp8_gemv_dq1 takes the row's max from partial maxima (attention's units), the max itself (the gate|up GEMV's
    atomic max) or the static scale, never reading the row for it: fp8_quantize + fp8_gemv's bits. With fold_out the
    residual GEMV also writes the next norm's xg, sums and maxima per 8 channels (int8's format)."""
    from kernels_cu.fp8_gemm import fp8_gemm_deferred
    from kernels_cu.int8_gemm import DeferredQuant
    from kernels_cu.norm_fold import FoldOut

    N = 1088 if epi == "fold" else 1000  # 1000: a partial 16-channel panel
    x = randn(1, K, seed=K + 7, scale=2.0)
    x[:, ::97] *= 20
    w8, w_scale = weight(N, K, seed=N + K + 1)
    static = torch.tensor([0.05], device="cuda") if source == "static" else None
    part = torch.stack([c.float().abs().amax(1) for c in x.tensor_split(7, dim=1)], 1)  # [1, 7]
    dq = DeferredQuant(x, part if source == "part" else None,
                       row_amax=part.amax(1) if source == "row_amax" else None)
    r = randn(1, N, seed=K + 8) if epi != "plain" else None
    nw = (1 + 0.1 * randn(N, seed=N).float()).half()
    fold = FoldOut.new(nw, 1, int8=True) if epi == "fold" else None
    if fold is not None:
        poison(fold.xg, fold.part, fold.mx)
    got = fp8_gemm_deferred(dq, w8, w_scale, static, residual=r, fold_out=fold)
    want = fp8_linear(x, w8, w_scale, static, residual=r, xq=False)
    assert_equal(got, want, f"dq1 K={K} {source} {epi}")
    if fold is not None:
        xg, mx, sq = fold_inputs(got, nw)
        assert_equal(fold.xg, xg, "fold xg")
        assert_equal(fold.mx, mx, "fold mx")
        compare(fold.part, sq, rtol=1e-5, what="fold sums")


@pytest.mark.parametrize("K", [576, 1040, 4096, 11008])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_fold_row_gemv_matches_its_reference(K, static, swiglu):
    """fp8_gemv_fq1 quantizes a deferred RMSNorm's xg from its producer's maxima and sums (fp8_fold_quantize_ref: the
    same codes when dynamic, a_scale within rsqrtf's ulps) and clears `zero`; with the SwiGLU and row_amax it also
    writes each 8 channels' max |y| and the row's max, exactly."""
    from kernels_cu.fp8_gemm import FoldQuant, fp8_fold_quantize_ref, fp8_gemm_fold

    h = randn(1, K, seed=K + 11, scale=3.0)
    h[:, ::97] *= 10
    nw = (1 + 0.1 * randn(K, seed=K + 12).float()).half()
    xg, mx, sq = fold_inputs(h, nw)
    N = 2 * 1040 if swiglu else 1000
    w8, w_scale = weight(N, K, seed=N + K + 2)
    scale = torch.tensor([0.02], device="cuda") if static else None
    zero = torch.full((1,), 5.0, device="cuda")
    fq = FoldQuant(xg, mx, sq, 1e-5, zero)
    row_amax = torch.zeros(1, device="cuda") if swiglu else None
    got = fp8_gemm_fold(fq, w8, w_scale, scale, swiglu=swiglu, row_amax=row_amax, maxima=swiglu)
    assert zero.item() == 0.0
    x8, a_scale = fp8_fold_quantize_ref(fq, scale)
    if swiglu:
        want = fp8_swiglu_ref(x8, a_scale, w8, w_scale)
        y = got.x
        assert_equal(got.part, y.float().abs().reshape(1, -1, 8).amax(-1), "SwiGLU maxima per 8 channels")
        assert_equal(row_amax, y.float().abs().amax(1), "the row's max")
        assert got.row_amax is row_amax
        assert rel_err(y, want) < (3e-2 if static else 2e-3), f"fq1_silu K={K} static={static}"
    else:
        y = got
        if static:  # rstd in inv: a code may flip against the float64 rstd
            assert rel_err(y, fp8_gemm_ref(x8, a_scale, w8, w_scale)) < 3e-2
        else:
            check_gemm(y, fp8_gemm_ref(x8, a_scale, w8, w_scale), f"fq1 K={K}")
    assert bool(torch.isfinite(y).all())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_deferred_launchers_refuse_bad_arguments():
    from kernels_cu.fp8_gemm import FoldQuant, fp8_gemm_deferred, fp8_gemm_fold
    from kernels_cu.int8_gemm import DeferredQuant

    w8, w_scale = weight(64, 128, seed=1)
    x = randn(2, 128, seed=2)
    with pytest.raises(ValueError, match="partial maxima or a static scale"):
        fp8_gemm_deferred(DeferredQuant(x, None), w8, w_scale)
    with pytest.raises(ValueError, match="maxima or a static scale"):
        fp8_gemm_deferred(DeferredQuant(x[:1], None), w8, w_scale)
    xg, mx, sq = fold_inputs(x, torch.ones(128, dtype=torch.float16, device="cuda"))
    amax = torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match="one-row"):
        fp8_gemm_fold(FoldQuant(xg, mx, sq, 1e-5), w8, w_scale, swiglu=True, row_amax=torch.zeros(2, device="cuda"),
                      maxima=True)
    with pytest.raises(ValueError, match="cannot clear"):
        fp8_gemm_fold(FoldQuant(xg[:1], mx[:1], sq[:1], 1e-5, amax), w8, w_scale, swiglu=True, row_amax=amax,
                      maxima=True)
    with pytest.raises(ValueError, match="SwiGLU epilogue"):
        fp8_gemm_fold(FoldQuant(xg[:1], mx[:1], sq[:1], 1e-5), w8, w_scale, row_amax=amax)


@pytest.mark.parametrize("K", [48, 576, 4096, 11008])
@pytest.mark.parametrize("T", [2, 7, 33])
@pytest.mark.parametrize("mode", ["parts", "parts-static", "norm", "norm-static"])
def test_quantize_fold_matches_its_reference(T, K, mode):
    """fp8_quantize_fold (a row over ceil(K / 1024) blocks): from partial maxima, fp8_quantize's bits; from a
    deferred norm's partials, fp8_fold_quantize_ref's codes (dynamic: bit for bit, a_scale within rsqrtf's ulps;
    static: rstd in inv, so a code may flip against the float64 rstd)."""
    from kernels_cu.fp8_gemm import FoldQuant, fp8_fold_quantize_ref
    from kernels_cu.fp8_quantize import fp8_quantize_fold

    static = torch.tensor([0.02], device="cuda") if mode.endswith("static") else None
    h = randn(T, K, seed=T + K, scale=3.0)
    h[:, ::97] *= 10
    if mode.startswith("parts"):
        part = torch.stack([c.float().abs().amax(1) for c in h.tensor_split(5, dim=1)], 1)  # [T, 5]
        x8, a_scale = fp8_quantize_fold(h, part, static_scale=static)
        want8, want_s = fp8_quantize_ref(h, static)
        assert_equal(x8.view(torch.uint8), want8.view(torch.uint8), f"codes T={T} K={K} {mode}")
        assert_equal(a_scale, want_s, f"scales T={T} K={K} {mode}")
        xh, h_scale = fp8_quantize_fold(h, part, static_scale=static, values=True)  # the codes' fp16 values
        assert_equal(xh, want8.to(torch.float16), f"values T={T} K={K} {mode}")
        assert_equal(h_scale, want_s, f"values' scales T={T} K={K} {mode}")
        return
    nw = (1 + 0.1 * randn(K, seed=K + 1).float()).half()
    xg, mx, sq = fold_inputs(h, nw)
    x8, a_scale = fp8_quantize_fold(xg, mx, sq, 1e-5, static)
    want8, want_s = fp8_fold_quantize_ref(FoldQuant(xg, mx, sq, 1e-5), static)
    if static is None:
        assert_equal(x8.view(torch.uint8), want8.view(torch.uint8), f"codes T={T} K={K} {mode}")
        compare(a_scale, want_s, rtol=1e-6, what=f"scales T={T} K={K}")
    else:
        flips = float((x8.view(torch.uint8) != want8.view(torch.uint8)).float().mean())
        assert flips < 1e-3, f"{flips:.2e} of the codes differ"
        assert_equal(a_scale, want_s, "static scales")


@pytest.mark.parametrize("M", [2, 9, 17, 33, 64])
def test_gemv_writes_the_next_norm_and_the_swiglu_maxima(M):
    """Beyond one row the residual GEMVs write the next norm's inputs (fold_out, int8's format) and the SwiGLU GEMV
    each 8 channels' max |y| (part, for the down_proj's fp8_quantize_fold), their outputs unchanged."""
    from kernels_cu.norm_fold import FoldOut

    K, N = 4112, 1088
    x8, a_scale = acts(M, K, seed=M + 60)
    w8, w_scale = weight(N, K, seed=M + 61)
    r = randn(M, N, seed=M + 62)
    nw = (1 + 0.1 * randn(N, seed=N + 3).float()).half()
    fold = FoldOut.new(nw, M, int8=True)
    poison(fold.xg, fold.part, fold.mx)
    y = fp8_gemm(x8, a_scale, w8, w_scale, residual=r, fold_out=fold)
    assert_equal(y, fp8_gemm(x8, a_scale, w8, w_scale, residual=r, wgmma=False), f"fold M={M}")
    xg, mx, sq = fold_inputs(y, nw)
    assert_equal(fold.xg, xg, "fold xg")
    assert_equal(fold.mx, mx, "fold mx")
    compare(fold.part, sq, rtol=1e-5, what="fold sums")
    part = torch.full((M, N // 16), float("nan"), device="cuda")
    a = fp8_swiglu(x8, a_scale, w8, w_scale, part=part)
    assert_equal(a, fp8_swiglu(x8, a_scale, w8, w_scale, wgmma=False), f"swiglu M={M}")
    assert_equal(part, a.float().abs().reshape(M, -1, 8).amax(-1), f"swiglu maxima M={M}")


# -- the wgmma GEMM (Hopper) ----------------------------------------------------------------------------------

def run_wgmma(M: int, K: int, N: int, seed: int, per_token: bool = True, residual: bool = False,
              variant: str | None = None):
    """The kernel's output inside a poisoned buffer with 8 spare rows (which must stay poisoned), and the reference.
    variant: a tile of fp8_wgmma.VARIANTS launched directly, or "library" (torch._scaled_mm, skipped where this torch
    cannot take the contract); None: fp8_gemm's choice."""
    if variant == "library" and not fp8_wgmma.library_takes(torch.cuda.current_device()):
        pytest.skip("this torch's _scaled_mm takes no row-wise scales with fp16 output")
    x8, a_scale = acts(M, K, seed=seed, static=not per_token)
    if not per_token:
        a_scale = a_scale[:1].contiguous()
    w8, w_scale = weight(N, K, seed=seed + 1)
    res = randn(M, N, seed=seed + 4) if residual else None
    big = torch.empty(M + 8, N, dtype=torch.float16, device="cuda")
    poison(big)
    if variant is None:
        fp8_gemm(x8, a_scale, w8, w_scale, residual=res, out=big[:M], wgmma=True)
    else:  # "library": launch's default path with the library on (the kernel only where _scaled_mm declines a shape)
        with build.on_stream(), tuning.override(fp8_prefill_library=True):
            fp8_wgmma.launch(big[:M], x8, a_scale, 1 if per_token else 0, w8, w_scale, res,
                             "res" if residual else "plain", None if variant == "library" else variant)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    return big[:M], fp8_gemm_ref(x8, a_scale, w8, w_scale, residual=res), abs_products(x8, a_scale, w8, w_scale)


def abs_products(x8, a_scale, w8, w_scale) -> torch.Tensor:
    """sum_k |x_k w_k| of each output, float64 [M, N]: the scale of what a truncating accumulator loses."""
    a = a_scale.double().reshape(-1).expand(x8.shape[0])
    acc = x8.float().abs().double() @ w8.float().abs().double().t()
    return acc * a[:, None] * w_scale.double()[None, :]


def check_wgmma(y: torch.Tensor, want: torch.Tensor, absum: torch.Tensor, what: str) -> None:
    """check_gemm's bounds plus what the tensor cores' own accumulation loses: within each 128-k chunk the e4m3
    wgmma adds its 32-k products into an accumulator that keeps ~14 bits (2^-13 of the running sum, four adds a
    chunk), before the kernel promotes the chunk into fp32: at most 2^-11 of sum |products|. Where the chunks
    cancel, that exceeds 2e-3 of the result."""
    assert bool(torch.isfinite(y).all()), what
    rms = float(want.float().pow(2).mean().sqrt())
    compare(y, want, rtol=2e-3, atol=2e-3 * rms + 2.0 ** -11 * absum.cpu(), what=what)
    rel = float((y.double() - want.double()).norm() / want.double().norm())
    assert rel < 1e-3, f"{what}: relative error {rel:.2e}"


@needs_wgmma
@pytest.mark.parametrize("K,N", [(4096, 12288), (4096, 4096), (11008, 4096), (4096, 22016), (576, 1536)])
@pytest.mark.parametrize("M", [128, 2048])
def test_wgmma_llama_shapes(M, K, N):
    y, want, absum = run_wgmma(M, K, N, seed=M + K + N)
    check_wgmma(y, want, absum, f"M={M} K={K} N={N}")


@needs_wgmma
@pytest.mark.parametrize("M,K,N", [(1, 128, 256), (17, 48, 32), (129, 1040, 208), (300, 576, 960),
                                   (255, 4112, 272), (65, 4096, 4096)])
def test_wgmma_ragged_tiles(M, K, N):
    """M, N and K not multiples of the 128 x 256 x 128 tile (K = 48: one partial stage)."""
    y, want, absum = run_wgmma(M, K, N, seed=5 * M + N)
    check_wgmma(y, want, absum, f"M={M} K={K} N={N}")


@needs_wgmma
@pytest.mark.parametrize("variant", [None, *VARIANTS])
@pytest.mark.parametrize("K", [4096, 11008])
def test_wgmma_long_positive_sums_keep_fp32_precision(K, variant):
    """All-positive codes: every add grows the sum, so an accumulator that truncates (Hopper's e4m3 wgmma keeps ~14
    bits) drifts the same way at each of K / 32 adds (~1% at K = 11008). The kernel sums 128 k's a chunk on the
    tensor cores and the chunks in fp32, which keeps the drift at ~1e-4 of the sum. Every tile variant: a round
    added twice, or not at all, or into the wrong columns, fails here too."""
    M, N = 192, 512
    x8, a_scale = fp8_quantize_ref(randn(M, K, seed=K).abs())
    w8, w_scale = contract.quantize_weight_fp8(randn(N, K, scale=0.05, seed=K + 1).float().abs())
    w8, w_scale = w8.contiguous(), w_scale.contiguous()
    if variant is None:
        y = fp8_gemm(x8, a_scale, w8, w_scale, wgmma=True)
    else:
        y = torch.empty(M, N, dtype=torch.float16, device="cuda")
        with build.on_stream():
            fp8_wgmma.launch(y, x8, a_scale, 1, w8, w_scale, None, "plain", variant)
    check_gemm(y, fp8_gemm_ref(x8, a_scale, w8, w_scale), f"positive K={K} variant={variant}")


@needs_wgmma
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_wgmma_resources(epi, variant):
    """The consumers' acc and chunk sets, the producer's copies: no spills (the producer keeps 40 registers)."""
    v = VARIANTS[variant]
    fn = build.get_function("fp8_wgmma.cu", f"fp8_wgmma_{epi}", fp8_wgmma.KERNEL_SIGNATURE, v.options())
    res = fn.resources()
    assert res["local_bytes"] == 0, res
    assert res["registers"] <= 255, res


@needs_wgmma
@pytest.mark.parametrize("variant", [*VARIANTS, "library"])
@pytest.mark.parametrize("M,K,N", [(2048, 4096, 4096), (2048, 11008, 4096), (300, 576, 960), (129, 1040, 208),
                                   (1, 128, 256), (255, 4112, 272), (17, 48, 32)])
def test_wgmma_variants(M, K, N, variant):
    """Every compiled tile (fp8_wgmma.VARIANTS) and the library path at LLaMA-2-7B's o / down shapes and ragged M, N
    and K (N past the last whole tile: 960 = 3.75 x 256 = 5 x 192; K = 48: one partial stage; K = 1040: a partial last
    stage)."""
    y, want, absum = run_wgmma(M, K, N, seed=3 * M + N, variant=variant)
    check_wgmma(y, want, absum, f"M={M} K={K} N={N} variant={variant}")


@needs_wgmma
@pytest.mark.parametrize("variant", [*VARIANTS, "library"])
def test_wgmma_variant_epilogues(variant):
    """The residual (static per-tensor scale) and SwiGLU epilogues of every tile and of the library path (the add and
    silu_mul after it), N not a multiple of any tile; the residual added in place (y is the residual)."""
    y, want, absum = run_wgmma(384, 4096, 1040, seed=13, per_token=False, residual=True, variant=variant)
    check_wgmma(y, want, absum, f"residual static variant={variant}")
    x8, a_scale = acts(256, 1024, seed=17)
    w8, w_scale = weight(528, 1024, seed=18)
    r = randn(256, 528, seed=19)
    want = fp8_gemm_ref(x8, a_scale, w8, w_scale, residual=r)
    with build.on_stream():
        fp8_wgmma.launch(r, x8, a_scale, 1, w8, w_scale, r, "res", variant)
    check_wgmma(r, want, abs_products(x8, a_scale, w8, w_scale), f"residual in place variant={variant}")
    M, K, F = 200, 1024, 520
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=M + K)
    big = torch.empty(M + 8, F, dtype=torch.float16, device="cuda")
    poison(big)
    with build.on_stream():
        fp8_wgmma.launch(big[:M], x8, a_scale, 1, w8, w_scale, None, "silu", variant)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    check_swiglu(big[:M], gate, up, want, f"wgmma swiglu variant={variant}")


@needs_wgmma
def test_wgmma_choice():
    """choose() takes a compiled tile for every LLaMA-2-7B prefill shape, and every tile's shared memory fits."""
    for name, v in VARIANTS.items():
        assert v.smem_bytes() <= 227 * 1024, name
    for n in (4096, 12288, 22016):
        assert fp8_wgmma.choose(2048, n, 132) in VARIANTS


@needs_wgmma
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_wgmma_epilogue_variants(per_token, residual):
    y, want, _ = run_wgmma(384, 4096, 1024, seed=11, per_token=per_token, residual=residual)
    check_gemm(y, want, f"per_token={per_token} residual={residual}")


@needs_wgmma
@pytest.mark.parametrize("M,K,F", [(100, 576, 1536), (2048, 4096, 11008), (129, 256, 40)])
def test_wgmma_swiglu_epilogue(M, K, F):
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=M + K)
    big = torch.empty(M + 8, F, dtype=torch.float16, device="cuda")
    poison(big)
    fp8_swiglu(x8, a_scale, w8, w_scale, out=big[:M], wgmma=True)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    check_swiglu(big[:M], gate, up, want, f"wgmma swiglu M={M} K={K} F={F}")


# -- the whole linear (quantize + GEMV / GEMM), as the engine calls it ----------------------------------------

@pytest.mark.parametrize("M", [1, 16, 64, 65, 512])
@pytest.mark.parametrize("static", [False, True])
def test_linear_chooses_its_kernel(M, static):
    K, N = 4096, 4096
    x = randn(M, K, seed=M)
    w8, w_scale = weight(N, K, seed=7)
    scale = torch.tensor([0.03], device="cuda") if static else None
    r = randn(M, N, seed=M + 2)
    y = fp8_linear(x, w8, w_scale, scale, residual=r)
    check_gemm(y, fp8_linear_ref(x, w8, w_scale, scale, residual=r), f"linear M={M} static={static}")


def test_launchers_refuse_bad_arguments():
    x8, a_scale = acts(4, 64, seed=1)
    w8, w_scale = weight(32, 64, seed=2)
    with pytest.raises(ValueError, match="K=64"):
        fp8_gemm(x8, a_scale, weight(32, 48, seed=3)[0], w_scale)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(x8, a_scale[:3].contiguous(), w8, w_scale)
    with pytest.raises(ValueError, match="x8 must be"):
        fp8_gemm(x8.view(torch.uint8).to(torch.int8), a_scale, w8, w_scale)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm(x8, a_scale, w8, w_scale.double())
    with pytest.raises(ValueError, match="residual"):
        fp8_gemm(x8, a_scale, w8, w_scale, residual=randn(4, 16))
    with pytest.raises(ValueError, match="static_scale"):
        fp8_quantize(randn(4, 64), torch.ones(2, device="cuda"))
