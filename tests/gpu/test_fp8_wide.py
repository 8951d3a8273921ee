"""The wide 32-row fp8 GEMVs (fp8_gemv_w2x*: 32 channels a block, tuning.fp8_gemv_block_channels) against the torch
reference and fp8_gemv_mt4: every epilogue the 32-row path serves (plain, residual, the next norm's fold outputs,
the SwiGLU and its maxima), ragged shapes, both block shapes (8 warps, or 4 two a SM), and the engine's 32-row
decode steps.

8-warp blocks sum each warp's k's and then the warps in mt4's order, so their outputs must be mt4's bit for bit;
4-warp blocks split K otherwise: within the reference's GEMM bound (check_gemm).
"""

import functools

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, check_gemm, check_swiglu, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, tuning  # noqa: E402
from kernels_cu.fp8_gemm import GEMV_SIGNATURE, fp8_gemm, fp8_gemm_ref, fp8_swiglu, wide_ring  # noqa: E402
from kernels_cu.fp8_quantize import has_fp8  # noqa: E402
from kernels_cu.gemm_shapes import cdiv, sm_count, smem_per_sm  # noqa: E402
from tests.gpu import test_fp8_kernels as base  # noqa: E402
from tests.gpu.test_fp8_kernels import acts, fold_inputs  # noqa: E402

weight = functools.lru_cache(maxsize=16)(base.weight)  # one weight per shape and seed for every mode
swiglu_case = functools.lru_cache(maxsize=16)(base.swiglu_case)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and has_fp8(torch.cuda.current_device())
         and smem_per_sm(torch.cuda.current_device()) >= wide_ring(8) + 4096),
    reason="the wide fp8 GEMV needs FP8 E4M3 and Hopper-sized shared memory")]

# (K, N): ragged K (one partial line) and N (a partial panel, a partial block), LLaMA-2-7B's o / down, and a grid of
# more blocks than SMs (4-warp blocks), N not a multiple of 32
KN = [(48, 37), (4112, 264), (576, 1536), (4096, 4096), (11008, 4096), (1040, 8456)]
# name -> (Tuning fields, whether the sums are mt4's bit for bit)
X8 = {"fp8_gemv_wide_two_blocks": False}
MODES = {
    "ch32": ({"fp8_gemv_block_channels": 32}, False),  # 4-warp blocks where the grid exceeds the SMs
    "ch32-x8": ({"fp8_gemv_block_channels": 32, **X8}, True),
}


def run(mode, fn, *args, **kw):
    with tuning.override(**MODES[mode][0]):
        return fn(*args, **kw)


def bitwise(mode) -> bool:
    return MODES[mode][1]


def mt4(fn, *args, **kw):
    """fn on fp8_gemv_mt4 (16 channels a block)."""
    with tuning.override(fp8_gemv_block_channels=16):
        return fn(*args, **kw)


def same_or_close(y, y_mt4, want, mode, what):
    """8-warp blocks: mt4's bits; else the reference's bound (checked by the caller too)."""
    if bitwise(mode):
        assert_equal(y, y_mt4, what)
    else:
        check_gemm(y, want, what)


@pytest.mark.parametrize("K,N", KN)
@pytest.mark.parametrize("M", [17, 23, 32, 64])
@pytest.mark.parametrize("mode", list(MODES))
def test_wide_gemv(M, K, N, mode):
    x8, a_scale = acts(M, K, seed=M + K)
    w8, w_scale = weight(N, K, seed=K + N)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    run(mode, fp8_gemm, x8, a_scale, w8, w_scale, out=y, wgmma=False)
    want = fp8_gemm_ref(x8, a_scale, w8, w_scale)
    check_gemm(y, want, f"wide {mode} M={M} K={K} N={N}")
    same_or_close(y, mt4(fp8_gemm, x8, a_scale, w8, w_scale, wgmma=False), want, mode, f"vs mt4 {mode} M={M}")


@pytest.mark.parametrize("M", [17, 32, 40])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_wide_residual_and_fold(M, static, mode):
    """The residual epilogue (per-token or one static scale), and with fold_out the next norm's inputs (int8's
    format) written beside an unchanged output."""
    from kernels_cu.norm_fold import FoldOut

    K, N = 4112, 8448  # the fold's H % 64; 264 blocks
    x8, a_scale = acts(M, K, seed=M + 80, static=static)
    if static:
        a_scale = a_scale[:1].contiguous()
    w8, w_scale = weight(N, K, seed=M + 81)
    r = randn(M, N, seed=M + 82)
    want = fp8_gemm_ref(x8, a_scale, w8, w_scale, residual=r)
    y = run(mode, fp8_gemm, x8, a_scale, w8, w_scale, residual=r, wgmma=False)
    check_gemm(y, want, f"wide res {mode} M={M}")
    same_or_close(y, mt4(fp8_gemm, x8, a_scale, w8, w_scale, residual=r, wgmma=False), want, mode,
                  f"res vs mt4 M={M}")
    nw = (1 + 0.1 * randn(N, seed=N + 5).float()).half()
    fold = FoldOut.new(nw, M, int8=True)
    poison(fold.xg, fold.part, fold.mx)
    yf = run(mode, fp8_gemm, x8, a_scale, w8, w_scale, residual=r, fold_out=fold)
    assert_equal(yf, y, f"fold output {mode} M={M}")
    xg, mx, sq = fold_inputs(y, nw)
    assert_equal(fold.xg, xg, "fold xg")
    assert_equal(fold.mx, mx, "fold mx")
    compare(fold.part, sq, rtol=1e-5, what="fold sums")


@pytest.mark.parametrize("K,F", [(256, 40), (576, 1536), (1040, 4232)])
@pytest.mark.parametrize("M", [17, 32, 64])
@pytest.mark.parametrize("mode", list(MODES))
def test_wide_swiglu_and_maxima(M, K, F, mode):
    """The SwiGLU epilogue on an interleaved gate|up weight, and each 8 channels' max |y| (part, for the down_proj's
    fp8_quantize_fold)."""
    x8, a_scale, w8, w_scale, want, gate, up = swiglu_case(M, K, F, seed=M + F + 90)
    y = torch.empty(M, F, dtype=torch.float16, device="cuda")
    poison(y)
    run(mode, fp8_swiglu, x8, a_scale, w8, w_scale, out=y, wgmma=False)
    check_swiglu(y, gate, up, want, f"wide swiglu {mode} M={M} K={K} F={F}")
    if bitwise(mode):
        assert_equal(y, mt4(fp8_swiglu, x8, a_scale, w8, w_scale, wgmma=False), f"swiglu vs mt4 M={M}")
    part = torch.full((M, F // 8), float("nan"), device="cuda")
    a = run(mode, fp8_swiglu, x8, a_scale, w8, w_scale, part=part)
    assert_equal(a, y, f"swiglu with maxima {mode} M={M}")
    assert_equal(part, a.float().abs().reshape(M, -1, 8).amax(-1), f"swiglu maxima {mode} M={M}")


def test_wide_kernel_choice_and_bad_value():
    """8-warp blocks up to one a SM, else 4-warp blocks (fp8_gemv_wide_two_blocks); 16 channels or integer-pipe
    weights: fp8_gemv_mt4 / mt4a; a value that is no block width: one error."""
    from kernels_cu.fp8_gemm import _wide_warps
    from model_zoo.errors import ConfigError

    x8 = torch.empty(32, 64, dtype=torch.uint8, device="cuda")
    sms = sm_count(torch.cuda.current_device())
    t32 = tuning.Tuning(fp8_gemv_block_channels=32)
    assert _wide_warps(t32, 32, 32 * sms, x8) == 8 and _wide_warps(t32, 33, 32 * sms, x8) == 4
    assert _wide_warps(tuning.Tuning(fp8_gemv_block_channels=32, **X8), 32, 12288, x8) == 8
    assert _wide_warps(tuning.Tuning(fp8_gemv_block_channels=16), 32, 4096, x8) == 0
    assert _wide_warps(tuning.Tuning(fp8_gemv_alu_weights=True), 32, 4096, x8) == 0  # mt4a
    with pytest.raises(ConfigError, match="fp8_gemv_block_channels"):
        _wide_warps(tuning.Tuning(fp8_gemv_block_channels=64), 32, 4096, x8)


@pytest.mark.parametrize("warps", [8, 4])
@pytest.mark.parametrize("epi", ["", "_res", "_silu"])
def test_wide_resources(warps, epi):
    """No spills; registers and the ring fit one 8-warp block a SM, or two 4-warp blocks."""
    res = build.get_function("fp8_gemv_wide.cu", f"fp8_gemv_w2x{warps}{epi}", GEMV_SIGNATURE).resources()
    assert res["local_bytes"] == 0, res
    blocks = 8 // warps
    assert cdiv(res["registers"], 8) * 8 * 32 * warps * blocks <= 65536, res
    assert blocks * (wide_ring(warps) + res["shared_bytes"] + 1024) <= smem_per_sm(torch.cuda.current_device()), res


@pytest.mark.parametrize("mode", ["ch32", "ch32-x8"])
def test_engine_32_row_steps(mode):
    """The engine's 32-row decode steps (the deferred chain's GEMVs: fold outputs, SwiGLU maxima) on the wide blocks:
    mt4's logits bit for bit where the sums are mt4's, the CPU reference's within the fp8 bound either way."""
    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.reference import ReferenceModel
    from tests.gpu.test_engine import CONFIGS, decode_steps, rel
    from tests.gpu.test_fp8_engine import LOGITS_REL, checkpoint

    config = CONFIGS["smol-like"]
    w = checkpoint(config, "fp8-dynamic")
    eng = Engine(w, EngineConfig(max_len=128)).variant(fp8_gemv_block_channels=16)  # mt4
    wide = eng.variant(**MODES[mode][0])
    tokens = torch.randint(0, config.vocab_size, (32, 24), generator=torch.Generator().manual_seed(11))
    on_mt4, got = (decode_steps(e, tokens, 12)[0] for e in (eng, wide))  # [12, 32, V]
    assert torch.isfinite(got).all()
    want = ReferenceModel(w.to("cpu", torch.float32)).forward(tokens)[:, 12:].transpose(0, 1)  # [12, 32, V]
    assert rel(got, want) < LOGITS_REL
    if bitwise(mode):
        assert torch.equal(got, on_mt4)
    else:
        assert rel(got, on_mt4) < 2e-2
