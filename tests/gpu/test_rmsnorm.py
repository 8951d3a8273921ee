"""rmsnorm.cu against its torch references: fp16 outputs within fp16 rounding, int8 outputs bit for bit."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.quantize import quantize_ref  # noqa: E402
from kernels_cu.rmsnorm import (add_rmsnorm, add_rmsnorm_quant, rmsnorm, rmsnorm_quant,  # noqa: E402
                                rmsnorm_ref)

pytestmark = pytest.mark.gpu
HIDDEN = [576, 4096, 8192]
TOKENS = [1, 7, 33]
EPS = 1e-5


def inputs(T, H, seed=0):
    x = randn(T, H, scale=3.0, seed=seed)  # [T, H]
    w = (1.0 + randn(H, scale=0.2, seed=seed + 1, dtype=torch.float32)).half()  # [H]
    return x, w


def exact_ref(x, w, eps):
    """No intermediate roundings at all: the fp64 oracle the fp16 kernel approximates."""
    x64 = x.double()
    return w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_rmsnorm(T, H):
    x, w = inputs(T, H)
    out = torch.empty(T, H, dtype=torch.float16, device="cuda")
    poison(out)
    rmsnorm(x, w, EPS, out=out)
    compare(out, rmsnorm_ref(x, w, EPS), rtol=2e-3, atol=1e-4, what="rmsnorm vs HF-order fp64 ref")
    compare(out, exact_ref(x, w, EPS), rtol=3e-3, atol=1e-4, what="rmsnorm vs exact fp64")


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_rmsnorm_quant_dynamic_is_bitwise(T, H):
    x, w = inputs(T, H, seed=3)
    y = rmsnorm(x, w, EPS)
    q = torch.empty(T, H, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    rmsnorm_quant(x, w, EPS, q=q, a_scale=s)
    q_ref, s_ref = quantize_ref(y)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
    # and the int8 value is the fp64 norm within half a quantization step (plus fp16 rounding)
    err = (q.double() * s.double()[:, None] - exact_ref(x, w, EPS)).abs()
    assert bool((err <= (0.5 + 1e-4) * s.double()[:, None] + 3e-3 * exact_ref(x, w, EPS).abs() + 1e-6).all())


@pytest.mark.parametrize("H", HIDDEN)
def test_rmsnorm_quant_static_saturates_like_ref(H):
    T = 7
    x, w = inputs(T, H, seed=5)
    y = rmsnorm(x, w, EPS)
    amax = (y.float().abs().max() * 0.6).reshape(1)  # below the true max: some values clamp to +-127
    q, s = rmsnorm_quant(x, w, EPS, static_amax=amax)
    q_ref, s_ref = quantize_ref(y, amax)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
    assert int((q.abs() == 127).sum()) > 0


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_add_rmsnorm_updates_residual_in_place(T, H):
    x, w = inputs(T, H, seed=7)
    r0 = randn(T, H, scale=2.0, seed=9)
    residual = r0.clone()
    out = torch.empty(T, H, dtype=torch.float16, device="cuda")
    poison(out)
    add_rmsnorm(residual, x, w, EPS, out=out)
    assert_equal(residual, r0 + x, "residual")
    compare(out, rmsnorm_ref(x, w, EPS, residual=r0), rtol=2e-3, atol=1e-4, what="add_rmsnorm")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_add_rmsnorm_quant_is_bitwise(T, H, static):
    x, w = inputs(T, H, seed=11)
    r0 = randn(T, H, scale=2.0, seed=13)
    y = add_rmsnorm(r0.clone(), x, w, EPS)
    amax = (y.float().abs().max() * 0.9).reshape(1) if static else None
    residual = r0.clone()
    q = torch.empty(T, H, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    add_rmsnorm_quant(residual, x, w, EPS, static_amax=amax, q=q, a_scale=s)
    assert_equal(residual, r0 + x, "residual")
    q_ref, s_ref = quantize_ref(y, amax)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")


def test_rejects_misaligned_and_wrong_dtype():
    x, w = inputs(4, 576)
    flat = torch.empty(4 * 576 + 8, dtype=torch.float16, device="cuda")
    shifted = flat[1:1 + 4 * 576].view(4, 576)  # 2 bytes off a 16-byte boundary
    shifted.copy_(x)
    with pytest.raises(ValueError, match="aligned"):
        rmsnorm(shifted, w, EPS)
    with pytest.raises(ValueError, match="float16"):
        rmsnorm(x.float(), w, EPS)
