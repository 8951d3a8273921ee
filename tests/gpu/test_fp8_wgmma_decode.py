"""fp8_wgmma_decode.cu (the FP8 E4M3 W8A8 GEMM of 17-64-row decode batches on Hopper wgmma: 64 channels x 32 / 64
tokens a block, weight by TMA and activations by cp.async into one ring, two-level accumulation, K split over
blocks) against the float64 reference and the GEMV's results.

The bound (test_fp8_kernels.check_wgmma, the prefill wgmma GEMM's): within each 128-k chunk the e4m3 wgmma adds its
32-k products into an accumulator that keeps ~14 bits (truncating) before the kernel promotes the chunk into fp32,
so an output may lose up to 2^-11 of sum_k |x_k w_k| (its products' magnitudes), on top of check_gemm's 2e-3 of the
result. Where the chunks cancel (outlier channels, a small result) that exceeds 2e-3 of the result: the GEMV, which
sums exactly converted fp16 products in fp32, does not lose it. How many stages are in flight does not change the
sums. The side outputs that are functions of the output (the fold's xg and maxima, the SwiGLU's maxima) must match
those functions of it bit for bit; K splits sum their partials in split order (the same bits every launch) and
leave the counters at zero.
"""

import functools

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, check_gemm, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, counters  # noqa: E402
from kernels_cu import fp8_wgmma_decode as dec  # noqa: E402
from kernels_cu.fp8_gemm import fp8_gemm  # noqa: E402
from kernels_cu.norm_fold import FoldOut  # noqa: E402
from kernels_cu.swiglu_layout import HALF  # noqa: E402
from tests.gpu import test_fp8_kernels as base  # noqa: E402
from tests.gpu.test_fp8_kernels import abs_products, acts, check_wgmma, fold_inputs  # noqa: E402

weight = functools.lru_cache(maxsize=16)(base.weight)
swiglu_case = functools.lru_cache(maxsize=16)(base.swiglu_case)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())),
    reason="wgmma e4m3 needs an sm_90 GPU")]

ROWS = [17, 24, 32, 48, 64]
# (K, N): one partial k tile and a partial channel block (N % 64 = 16), ragged K (4112 = 32 tiles + 16), a single
# panel, LLaMA-2-7B's o / down / q|k|v, and a wide N of 529 panels with cancelling outlier chunks
KN = [(48, 80), (4112, 272), (576, 16), (4096, 4096), (11008, 4096), (4096, 12288), (1040, 8464)]


def counters_zero() -> bool:
    torch.cuda.synchronize()
    return not any(bool(c.any()) for c in counters.pools(dec.COUNTER_POOL))


def run(x8, a_scale, w8, w_scale, cols_out, **kw):
    """The kernel's output in a NaN-filled buffer with 8 spare rows (which must stay NaN)."""
    M = x8.shape[0]
    big = torch.full((M + 8, cols_out), float("nan"), dtype=torch.float16, device="cuda")
    y = dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, out=big[:M], **kw)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    return y


def check_swiglu_wgmma(y, x8, a_scale, w8, w_scale, gate, up, want, what: str) -> None:
    """conftest.check_swiglu's propagation of each product's error through silu(gate) * up, each product's error
    check_wgmma's (2e-3 of its rms + 2^-11 of its sum of |products|), plus fp16 rounding of the result."""
    M, F = gate.shape
    absum = abs_products(x8, a_scale, w8, w_scale).cpu().reshape(M, F // HALF, 2, HALF)  # interleaved -> gate, up
    ag, au = absum[:, :, 0].reshape(M, F), absum[:, :, 1].reshape(M, F)
    gate, up, ref = gate.double().cpu(), up.double().cpu(), want.double().cpu()
    eg = 2e-3 * float(gate.pow(2).mean().sqrt()) + 2.0 ** -11 * ag
    eu = 2e-3 * float(up.pow(2).mean().sqrt()) + 2.0 ** -11 * au
    bound = eg * 1.1 * up.abs() + torch.nn.functional.silu(gate).abs() * eu + 2e-3 * ref.abs() + eg * eu
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"{what}: worst excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("K,N", KN)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_plain(M, K, N, splits):
    """Every token tile (17-32 rows: n32, 33-64: n64, rows past M zero-filled), the launcher's splits, none, and 3
    (unequal splits where the tiles do not divide)."""
    x8, a_scale = acts(M, K, seed=M + K)
    w8, w_scale = weight(N, K, seed=K + N)
    y = run(x8, a_scale, w8, w_scale, N, splits=splits)
    absum = abs_products(x8, a_scale, w8, w_scale)
    check_wgmma(y, dec.fp8_wgmma_decode_ref(x8, a_scale, w8, w_scale), absum, f"M={M} K={K} N={N} splits={splits}")
    check_wgmma(y, fp8_gemm(x8, a_scale, w8, w_scale, wgmma=False), absum, f"vs the GEMV M={M} K={K} N={N}")
    assert_equal(dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, splits=splits), y, "a second launch")
    assert counters_zero(), "counters left non-zero"


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("splits", [None, 1])
def test_residual_and_fold(M, static, splits):
    """The residual epilogue (per-token or one static scale), in place into the residual as the engine runs it, and
    with fold_out the next norm's inputs (int8's format) beside the same output."""
    K, N = 4112, 4096  # the fold's H % 64; o_proj's width (6 splits by default)
    x8, a_scale = acts(M, K, seed=M + 80, static=static)
    if static:
        a_scale = a_scale[:1].contiguous()
    w8, w_scale = weight(N, K, seed=M + 81)
    r = randn(M, N, seed=M + 82)
    want = dec.fp8_wgmma_decode_ref(x8, a_scale, w8, w_scale, residual=r)
    y = run(x8, a_scale, w8, w_scale, N, residual=r, splits=splits)
    check_wgmma(y, want, abs_products(x8, a_scale, w8, w_scale), f"res M={M} static={static}")
    inplace = r.clone()
    dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, residual=inplace, out=inplace, splits=splits)
    assert_equal(inplace, y, "in place into the residual")
    nw = (1 + 0.1 * randn(N, seed=N + 5).float()).half()
    fold = FoldOut.new(nw, M, int8=True)
    poison(fold.xg, fold.part, fold.mx)
    yf = dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, residual=r, fold_out=fold, splits=splits)
    assert_equal(yf, y, f"fold output M={M}")
    xg, mx, sq = fold_inputs(y, nw)
    assert_equal(fold.xg, xg, "fold xg")
    assert_equal(fold.mx, mx, "fold mx")
    compare(fold.part, sq, rtol=1e-5, what="fold sums")
    assert counters_zero(), "counters left non-zero"


@pytest.mark.parametrize("K,F", [(256, 40), (576, 1536), (1040, 4232), (4096, 11008)])
@pytest.mark.parametrize("M", [17, 32, 48, 64])
@pytest.mark.parametrize("splits", [None, 2])
def test_swiglu_and_maxima(M, K, F, splits):
    """The SwiGLU of an interleaved gate|up weight (F = 40: a partial channel block), and each 8 outputs' max |y|
    (part, for the down_proj's fp8_quantize_fold)."""
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=M + F + 90)
    y = run(x8, a_scale, w8, w_scale, F, swiglu=True, splits=splits)
    check_swiglu_wgmma(y, x8, a_scale, w8, w_scale, gate, up, want, f"swiglu M={M} K={K} F={F} splits={splits}")
    part = torch.full((M, F // 8), float("nan"), device="cuda")
    a = dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, swiglu=True, part=part, splits=splits)
    assert_equal(a, y, f"swiglu with maxima M={M}")
    assert_equal(part, a.float().abs().reshape(M, -1, 8).amax(-1), f"swiglu maxima M={M}")


def test_all_positive_sums_keep_fp32():
    """All-positive products over K = 11008 (down_proj): e4m3 wgmma's own accumulator (~14 bits, truncating) drifts
    ~1% here; the chunks promoted into fp32 every 128 k's keep the result within check_gemm's plain bound."""
    M, K, N = 32, 11008, 256
    g = torch.Generator(device="cuda").manual_seed(7)
    x8 = (torch.rand(M, K, device="cuda", generator=g) * 8 + 1).to(torch.float8_e4m3fn)  # [M, K]
    w8 = (torch.rand(N, K, device="cuda", generator=g) * 8 + 1).to(torch.float8_e4m3fn)  # [N, K]
    a, ws = torch.full((M,), 1e-4, device="cuda"), torch.full((N,), 1e-3, device="cuda")
    for splits in (1, 4):
        y = dec.fp8_wgmma_decode(x8, a, w8, ws, splits=splits)
        check_gemm(y, dec.fp8_wgmma_decode_ref(x8, a, w8, ws), f"all positive, splits={splits}")


@pytest.mark.parametrize("N,splits", [(12288, 1), (4096, 6)])
def test_graph_replay_with_a_kept_weight_map(N, splits):
    """Under CUDA-graph capture with the weight's map kept from before it (no put_map kernel, the weights copied
    before the PDL wait): replays give the eager bits, also after the inputs change in place; split K's counters
    serve every replay. And a weight without a kept map (put_map in the graph)."""
    M, K = 32, 4096
    x8, a_scale = acts(M, K, seed=5)
    w8, w_scale = weight(N, K, seed=6)
    w8b = w8.clone()  # the same codes at another address: no kept map
    kept = dec.keep_weight_map(w8)
    assert dec.keep_weight_map(w8) is kept  # one map per weight
    r = randn(M, N, seed=7)
    y, y2 = (torch.empty(M, N, dtype=torch.float16, device="cuda") for _ in range(2))
    dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, residual=r, out=y, splits=splits)  # modules, counters eagerly
    eager = y.clone()
    ts = build.torch_stream()
    ts.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=ts):
        dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, residual=r, out=y, splits=splits)
        dec.fp8_wgmma_decode(x8, a_scale, w8b, w_scale, residual=r, out=y2, splits=splits)
    poison(y, y2)
    g.replay()
    ts.synchronize()
    assert_equal(y, eager, "replay")
    assert_equal(y2, eager, "replay, the map made under the capture")
    x2, a2 = acts(M, K, seed=8)
    x8.copy_(x2)
    a_scale.copy_(a2)
    g.replay()
    ts.synchronize()
    check_wgmma(y, dec.fp8_wgmma_decode_ref(x8, a_scale, w8, w_scale, residual=r),
                abs_products(x8, a_scale, w8, w_scale), "replay on new inputs")
    assert_equal(y2, y, "both maps on new inputs")
    assert counters_zero(), "counters left non-zero"


@pytest.mark.parametrize("epi", dec.EPILOGUES)
@pytest.mark.parametrize("bt", [32, 64])
def test_resources(bt, epi):
    """Three blocks a SM: at most 136 registers (65,536 / 480 threads), no spills; the ring as smem_bytes says."""
    fn = build.get_function("fp8_wgmma_decode.cu", f"fp8_wgmma_decode_t{bt}_{epi}", dec.SIGNATURE)
    res = fn.resources()
    assert res["registers"] <= 136 and res["local_bytes"] == 0, res
    assert 3 * (dec.smem_bytes(bt) + res["shared_bytes"] + 1024) <= 228 * 1024


def test_bad_inputs():
    """One clear error each: N not whole panels, K not 16-byte rows, a fold without a residual, maxima without the
    SwiGLU, a misaligned x8."""
    from model_zoo.errors import ConfigError

    x8, a_scale = acts(20, 256, seed=1)
    w8, w_scale = weight(64, 256, seed=2)
    with pytest.raises(ConfigError, match="N"):
        dec.fp8_wgmma_decode(x8, a_scale, w8[:40].contiguous(), w_scale[:40].contiguous())
    x8k, _ = acts(20, 72, seed=3)
    w8k, wsk = weight(64, 72, seed=4)
    with pytest.raises(ConfigError, match="K"):
        dec.fp8_wgmma_decode(x8k, a_scale, w8k, wsk)
    fold = FoldOut.new(torch.ones(64, dtype=torch.float16, device="cuda"), 20, int8=True)
    with pytest.raises(ValueError, match="residual"):
        dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, fold_out=fold)
    with pytest.raises(ValueError, match="SwiGLU"):
        dec.fp8_wgmma_decode(x8, a_scale, w8, w_scale, part=torch.zeros(20, 4, device="cuda"))
    odd = torch.empty(20 * 256 + 8, dtype=torch.uint8, device="cuda")[8:].view(20, 256)  # 8-byte aligned
    odd.copy_(x8.view(torch.uint8))
    with pytest.raises(ValueError, match="aligned"):
        dec.fp8_wgmma_decode(odd, a_scale, w8, w_scale)
    assert not dec.runs(odd, w8)  # fp8_gemm sends it to the GEMV instead
