"""quantize.cu against quantize_ref: q and a_scale bit for bit, dynamic and static."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.quantize import dequantize_ref, quantize, quantize_ref  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("K", [576, 4096, 11008, 28672])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_dynamic_is_bitwise(T, K):
    x = randn(T, K, scale=4.0, seed=T * K)
    q = torch.empty(T, K, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    quantize(x, q=q, a_scale=s)
    q_ref, s_ref = quantize_ref(x)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
    assert int(q.abs().max()) == 127  # the row maximum maps to +-127
    err = (dequantize_ref(q, s) - x.float()).abs()
    assert bool((err <= (0.5 + 1e-4) * s[:, None]).all())


@pytest.mark.parametrize("K", [576, 4096])
@pytest.mark.parametrize("T", [1, 33])
def test_static_is_bitwise_and_writes_the_scale(T, K):
    x = randn(T, K, scale=2.0, seed=1)
    amax = torch.tensor([3.5], device="cuda")  # N(0, 4) values beyond 3.5 saturate
    q = torch.empty(T, K, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    quantize(x, static_amax=amax, q=q, a_scale=s)
    q_ref, s_ref = quantize_ref(x, amax)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
    assert_equal(s, torch.full_like(s, 3.5) / torch.full_like(s, 127.0), "a_scale = amax / 127")


def test_zero_row_uses_the_amax_floor():
    x = randn(3, 64, seed=2)
    x[1] = 0  # the one deliberate zero row: amax clamps to 1e-8 instead of dividing by zero
    q, s = quantize(x)
    q_ref, s_ref = quantize_ref(x)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")
    assert int(q[1].abs().max()) == 0 and float(s[1]) > 0


def test_static_amax_can_change_between_calls_without_new_pointers():
    x = randn(5, 576, seed=3)
    amax = torch.tensor([1.0], device="cuda")
    q1, _ = quantize(x, static_amax=amax)
    amax.fill_(8.0)  # what a captured graph would see on its next replay
    q2, _ = quantize(x, static_amax=amax)
    assert_equal(q2, quantize_ref(x, amax)[0], "q after the amax changed")
    assert not torch.equal(q1, q2)
