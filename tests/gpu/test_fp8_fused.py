"""The fp8 quantization fused into the kernels that make an fp8 GEMM's input (prefill, and decode steps where
cuBLASLt takes the products), and the prefill's last-position logits.

fp8_rmsnorm (with or without the residual add) and fp8_silu_mul write the codes that the fp16 kernel followed by
fp8_quantize writes, bit for bit; so an engine with tuning.fp8_fused_quant gives the logits of one without it, bit
for bit (the residual add moved into the norm kernel is the same fp16 sum). forward(last=True) gives the last
position's logits of the full prefill, for every scheme.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.fp8_quantize import (fp8_quantize, fp8_quantize_ref, fp8_rmsnorm, fp8_rmsnorm_ref,  # noqa: E402
                                     fp8_silu_mul, fp8_silu_mul_ref)
from kernels_cu.rmsnorm import add_rmsnorm, rmsnorm  # noqa: E402
from kernels_cu.silu_mul import silu_mul_interleaved  # noqa: E402
from tests.gpu import test_fp8_kernels  # noqa: E402
from tests.gpu.test_engine import CONFIGS, decode_steps, rel  # noqa: E402
from tests.gpu.test_fp8_engine import LOGITS_REL, checkpoint  # noqa: E402

pytestmark = test_fp8_kernels.pytestmark  # a GPU with FP8 E4M3
HOPPER = test_fp8_kernels.HOPPER
EPS = 1e-5


def codes_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert_equal(a.view(torch.uint8), b.view(torch.uint8), what)


def near_ref(x8: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor) -> None:
    """Dequantized codes within half an e4m3 step of the float64 value (2^-4 relative; 2^-10 of the scale below the
    smallest normal), plus the fp16 roundings before the quantization."""
    got = x8.float().double() * scale.double()[:, None]
    err = (got - ref.double()).abs()
    bound = 0.066 * ref.double().abs() + scale.double()[:, None] * 2.0 ** -9 + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("H", [64, 576, 4096, 8192])
@pytest.mark.parametrize("T", [1, 7, 33, 130])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_codes_are_rmsnorm_then_quantize_bitwise(T, H, static, residual):
    h = randn(T, H, scale=3.0, seed=T + H)
    h[0, :2] = torch.tensor([300.0, -5e3], dtype=torch.float16)  # an outlier row: the rest of it underflows e4m3
    w = (1.0 + randn(H, scale=0.2, seed=H + 1, dtype=torch.float32)).half()
    scale = torch.tensor([0.01], device="cuda") if static else None  # saturates the outliers
    r0 = randn(T, H, scale=2.0, seed=T + 5) if residual else None
    if residual:
        r_fused, r_plain = r0.clone(), r0.clone()
        y = add_rmsnorm(r_plain, h, w, EPS)  # r_plain += h, then its norm
    else:
        r_fused, y = None, rmsnorm(h, w, EPS)
    x8, a_scale = fp8_rmsnorm(h, w, EPS, scale, residual=r_fused)
    q_k, s_k = fp8_quantize(y, scale)
    codes_equal(x8, q_k, "codes vs rmsnorm + fp8_quantize")
    assert_equal(a_scale, s_k, "a_scale")
    q_r, s_r = fp8_quantize_ref(y, scale)
    codes_equal(x8, q_r, "codes vs the torch reference of the norm kernel's output")
    assert_equal(a_scale, s_r, "a_scale vs reference")
    if residual:
        assert_equal(r_fused, r0 + h, "residual += h in place (torch's fp16 add)")
    ref = rmsnorm_ref_value(h, w, r0)
    if not static:  # the static scale clips the outliers by design
        near_ref(x8, a_scale, ref)
    want8, _ = fp8_rmsnorm_ref(h, w, EPS, scale, r0)
    same = (x8.view(torch.uint8) == want8.view(torch.uint8)).float().mean()
    assert float(same) > 0.95  # the fp64 HF-order reference: an fp16 ulp apart here and there (a row max moves codes)


def rmsnorm_ref_value(h: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    s = (h if r is None else r + h).double()
    return w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("F", [8, 1536, 11008, 14336])
@pytest.mark.parametrize("T", [1, 7, 33, 130])
@pytest.mark.parametrize("static", [False, True])
def test_silu_codes_are_silu_mul_interleaved_then_quantize_bitwise(T, F, static):
    y = randn(T, 2 * F, scale=3.0, seed=T * F + 3)
    scale = torch.tensor([0.02], device="cuda") if static else None
    x8, a_scale = fp8_silu_mul(y, scale)
    v = silu_mul_interleaved(y)
    q_k, s_k = fp8_quantize(v, scale)
    codes_equal(x8, q_k, "codes vs silu_mul_interleaved + fp8_quantize")
    assert_equal(a_scale, s_k, "a_scale")
    want8, _ = fp8_silu_mul_ref(y, scale)
    same = (x8.view(torch.uint8) == want8.view(torch.uint8)).float().mean()
    assert float(same) > 0.95  # torch's silu may round an fp16 ulp apart from the kernel's expf


def test_fused_launchers_check_their_arguments():
    h = randn(4, 36)
    with pytest.raises(Exception, match="multiple of 8"):
        fp8_rmsnorm(h, randn(36), EPS)
    with pytest.raises(ValueError, match="shape"):
        fp8_rmsnorm(randn(4, 64), randn(64), EPS, residual=randn(3, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_silu_mul(randn(4, 40))
    x8, s = fp8_rmsnorm(randn(0, 64), randn(64), EPS)
    assert x8.shape == (0, 64) and s.shape == (0,)


@pytest.mark.skipif(not HOPPER, reason="the fused path runs where cuBLASLt takes the fp8 products (Hopper)")
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
@pytest.mark.parametrize("name", ["smol-like", "gqa4-d64"])
def test_prefill_with_fused_quantization_equals_the_separate_kernels_bitwise(name, scheme):
    """2 x 45 tokens: 90 rows, beyond the GEMV's 64, so the products run on cuBLASLt and the norm, SwiGLU and
    residual adds fuse (tuning.fp8_fused_quant); off: rmsnorm, fp8_quantize, silu_mul_interleaved, torch.add."""
    from kernels_cu import fp8_wgmma
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS[name]
    eng = Engine(checkpoint(config, scheme), EngineConfig(max_len=128, prefill_graphs=False))
    if not fp8_wgmma.library_takes(torch.cuda.current_device()):
        pytest.skip("this torch's _scaled_mm does not take the fp8 contract")
    tokens = torch.randint(0, config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(11))
    fused = eng.forward(tokens)
    plain = eng.variant(fp8_fused_quant=False).forward(tokens)
    assert torch.isfinite(fused).all() and torch.equal(fused, plain)


@pytest.mark.parametrize("scheme", ["fp16", "int8-dynamic", "awq", "fp8-dynamic"])
def test_last_position_logits_equal_the_full_prefills_last_row(scheme):
    """forward(last=True): the final norm and the lm_head on each row's last position only, eager and replayed."""
    from kernels_cu.engine import Engine, EngineConfig
    from tests.gpu.test_engine import engine_and_ref

    config = CONFIGS["gqa4-d64"]
    if scheme.startswith("fp8"):
        eng = Engine(checkpoint(config, scheme), EngineConfig(max_len=128))
    else:
        eng = engine_and_ref(config, scheme)[0]
    tokens = torch.randint(0, config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(5))
    cache = eng.new_cache(3, 32)
    full = eng.forward(tokens, cache)  # [3, 21, V]
    for _ in range(3):  # eager, then the graph captured on the shape's second run, replayed
        cache.lengths.zero_()
        last = eng.forward(tokens, cache, last=True)
        assert last.shape == (3, 1, config.vocab_size)
        assert rel(last, full[:, -1:]) < 1e-3  # the head on 3 rows, not 63: another GEMM's summation order
    assert cache.lengths.tolist()[:3] == [21, 21, 21]


@pytest.mark.skipif(not HOPPER, reason="cuBLASLt's fp8 products from tuning.fp8_library_min_m rows (Hopper)")
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
def test_decode_on_cublaslt_rows_matches_reference(scheme):
    """tuning.fp8_library_min_m = 17: a 20-row decode step runs cuBLASLt's products with the fused norm, SwiGLU
    and residual kernels instead of the chain: the reference's logits to the fp8 bound, graphed and eager."""
    from kernels_cu import fp8_wgmma
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.engine.plan import StepPlan
    from model_zoo.reference import ReferenceModel

    config = CONFIGS["smol-like"]
    w = checkpoint(config, scheme)
    base = Engine(w, EngineConfig(max_len=128))
    if not fp8_wgmma.library_takes(torch.cuda.current_device()):
        pytest.skip("this torch's _scaled_mm does not take the fp8 contract")
    eng = base.variant(fp8_library_min_m=17)
    assert eng.plan(32) == StepPlan() and eng.plan(16) != StepPlan()
    ref = ReferenceModel(w.to("cpu", torch.float32))
    tokens = torch.randint(0, config.vocab_size, (20, 24), generator=torch.Generator().manual_seed(7))
    got = decode_steps(eng, tokens, 12)[0]  # [12, 20, V]
    want = ref.forward(tokens)[:, 12:].transpose(0, 1)
    assert torch.isfinite(got).all() and rel(got, want) < LOGITS_REL
    eager = Engine(w, EngineConfig(max_len=128, use_graphs=False)).variant(fp8_library_min_m=17)
    assert rel(decode_steps(eager, tokens, 12)[0], got) < 1e-3

