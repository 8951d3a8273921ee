"""silu_mul.cu against F.silu(g) * u: fp16 within 2e-3 of float64, int8 variants bit for bit."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.quantize import quantize_ref  # noqa: E402
from kernels_cu.silu_mul import silu_mul, silu_mul_quant, silu_mul_ref  # noqa: E402

pytestmark = pytest.mark.gpu
FFN = [1536, 11008, 14336, 28672]
TOKENS = [1, 7, 33]


@pytest.mark.parametrize("F", FFN)
@pytest.mark.parametrize("T", TOKENS)
def test_silu_mul(T, F):
    gate_up = randn(T, 2 * F, scale=3.0, seed=F + T)
    out = torch.empty(T, F, dtype=torch.float16, device="cuda")
    poison(out)
    silu_mul(gate_up, out=out)
    compare(out, silu_mul_ref(gate_up), rtol=2e-3, atol=1e-4, what="vs torch fp16")
    compare(out, silu_mul_ref(gate_up, torch.float64), rtol=2e-3, atol=1e-4, what="vs float64")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("F", FFN)
@pytest.mark.parametrize("T", TOKENS)
def test_silu_mul_quant_is_bitwise(T, F, static):
    gate_up = randn(T, 2 * F, scale=3.0, seed=F * T + 1)
    y = silu_mul(gate_up)
    amax = (y.float().abs().max() * 0.7).reshape(1) if static else None
    q = torch.empty(T, F, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    silu_mul_quant(gate_up, static_amax=amax, q=q, a_scale=s)
    q_ref, s_ref = quantize_ref(y, amax)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
