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

from kernels_cu import build  # noqa: E402
from kernels_cu.fp8_gemm import (SIGNATURE, XQ_SIGNATURE, fp8_gemm, fp8_gemm_ref, fp8_linear,  # noqa: E402
                                 fp8_linear_ref, fp8_swiglu, fp8_swiglu_ref)
from kernels_cu.fp8_quantize import FP8, fp8_quantize, fp8_quantize_ref, has_fp8  # noqa: E402
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
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16, 33, 64])
def test_gemv(M, K, N):
    x8, a_scale = acts(M, K, seed=M)
    w8, w_scale = weight(N, K, seed=K + N)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    fp8_gemm(x8, a_scale, w8, w_scale, out=y, wgmma=False)
    want = fp8_gemm_ref(x8, a_scale, w8, w_scale)
    check_gemm(y, want, f"M={M} K={K} N={N}")
    # model_zoo's fp32 contract, as the CPU reference computes it
    check_gemm(y, contract.fp8_gemm_ref(x8, w8, a_scale, w_scale, torch.float16), f"contract M={M} K={K} N={N}")


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


@pytest.mark.parametrize("kind,epi", [(k, e) for k in ("mt1", "mt2", "xq", "xq1") for e in ("", "_res", "_silu")]
                         + [(k, e) for k in ("nq", "nq1") for e in ("", "_silu")])
def test_gemv_resources(kind, epi):
    """No variant spills; registers and the ring leave two resident blocks a SM (three at one token tile)."""
    from kernels_cu.fp8_gemm import NQ_SIGNATURE
    from kernels_cu.gemm_shapes import GEMV_RING_BYTES, smem_per_sm

    sig = {"xq": XQ_SIGNATURE, "nq": NQ_SIGNATURE}.get(kind.rstrip("1"), SIGNATURE)
    res = build.get_function("fp8_gemm.cu", f"fp8_gemv_{kind}{epi}", sig).resources()
    assert res["local_bytes"] == 0, res
    blocks = 2 if kind == "mt2" else 3
    assert cdiv(res["registers"], 8) * 8 * 256 * blocks <= 65536, res
    assert blocks * (GEMV_RING_BYTES + res["shared_bytes"] + 1024) <= smem_per_sm(torch.cuda.current_device())


@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("static", [False, True])
def test_self_quantizing_gemv_is_quantize_then_gemv_bitwise(M, epi, static):
    """fp8_gemv_xq finds each row's scale and quantizes in its main loop: fp8_quantize + fp8_gemv's bits."""
    K, N = (4096, 2 * 1536) if epi == "silu" else (11008, 4096)
    x = randn(M, K, seed=M + 40, scale=2.0)
    x[:, ::97] *= 20
    w8, w_scale = weight(N, K, seed=N + 1)
    scale = torch.tensor([0.05], device="cuda") if static else None
    r = randn(M, N, seed=M + 41) if epi == "res" else None
    got = fp8_linear(x, w8, w_scale, scale, residual=r, swiglu=epi == "silu", xq=True)
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


# -- the wgmma GEMM (Hopper) ----------------------------------------------------------------------------------

def run_wgmma(M: int, K: int, N: int, seed: int, per_token: bool = True, residual: bool = False):
    """The kernel's output inside a poisoned buffer with 8 spare rows (which must stay poisoned), and the reference."""
    x8, a_scale = acts(M, K, seed=seed, static=not per_token)
    if not per_token:
        a_scale = a_scale[:1].contiguous()
    w8, w_scale = weight(N, K, seed=seed + 1)
    res = randn(M, N, seed=seed + 4) if residual else None
    big = torch.empty(M + 8, N, dtype=torch.float16, device="cuda")
    poison(big)
    fp8_gemm(x8, a_scale, w8, w_scale, residual=res, out=big[:M], wgmma=True)
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
@pytest.mark.parametrize("K", [4096, 11008])
def test_wgmma_long_positive_sums_keep_fp32_precision(K):
    """All-positive codes: every add grows the sum, so an accumulator that truncates (Hopper's e4m3 wgmma keeps ~14
    bits) drifts the same way at each of K / 32 adds (~1% at K = 11008). The kernel sums 128 k's a chunk on the
    tensor cores and the chunks in fp32, which keeps the drift at ~1e-4 of the sum."""
    M, N = 192, 512
    x8, a_scale = fp8_quantize_ref(randn(M, K, seed=K).abs())
    w8, w_scale = contract.quantize_weight_fp8(randn(N, K, scale=0.05, seed=K + 1).float().abs())
    w8, w_scale = w8.contiguous(), w_scale.contiguous()
    y = fp8_gemm(x8, a_scale, w8, w_scale, wgmma=True)
    check_gemm(y, fp8_gemm_ref(x8, a_scale, w8, w_scale), f"positive K={K}")


@needs_wgmma
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_wgmma_resources(epi):
    """acc (128 fp32) + the chunk (64) + the copies' addresses fit 255 registers without spills."""
    from kernels_cu.fp8_wgmma import SIGNATURE as WG_SIGNATURE

    res = build.get_function("fp8_wgmma.cu", f"fp8_wgmma_{epi}", WG_SIGNATURE).resources()
    assert res["local_bytes"] == 0, res
    assert res["registers"] <= 255, res


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
