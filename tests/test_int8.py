"""INT8 W8A8 numerics: known answers, exact int32 GEMM, and Int8Linear against the contract."""

import pytest
import torch

from model_zoo.errors import ConfigError
from model_zoo.linear import Linear
from model_zoo.quant.int8 import (MAX_IN_FEATURES, ActQuant, dequantize_weight_int8, fake_quant_linear, int8_gemm_ref,
                                  int8_matmul, quantize_act_per_token, quantize_act_static, quantize_weight_int8)
from model_zoo.quant.linear import Int8Linear


def test_weight_known_answer_per_output_channel():
    w = torch.tensor([[127.0, -63.5, 0.25, 1.0],  # amax 127 -> scale 1; -63.5 is a tie -> -64 (half to even)
                      [0.0, 0.0, 0.0, 0.0],  # all zero -> scale clamped, codes 0
                      [-2.54, 1.27, 0.0, 0.02]])
    qweight, w_scale = quantize_weight_int8(w)
    assert qweight.dtype == torch.int8 and w_scale.dtype == torch.float32
    assert qweight[0].tolist() == [127, -64, 0, 1]
    assert w_scale[0].item() == 1.0
    assert qweight[1].tolist() == [0, 0, 0, 0] and w_scale[1].item() == pytest.approx(1e-8 / 127)
    assert qweight[2].tolist() == [-127, 64, 0, 1]  # 1.27 / 0.02 = 63.5 -> 64; 0.02 / 0.02 = 1
    assert w_scale[2].item() == pytest.approx(2.54 / 127)


def test_weight_round_trip_error_is_half_a_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    qweight, w_scale = quantize_weight_int8(w)
    err = (dequantize_weight_int8(qweight, w_scale) - w).abs()
    assert (err <= w_scale[:, None] / 2 * (1 + 1e-5)).all()
    assert qweight.abs().max(dim=1).values.eq(127).all()  # each row's largest weight maps to 127


def test_scale_dtype_rounds_the_scale_before_coding():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    qweight, w_scale = quantize_weight_int8(w, scale_dtype=torch.float16)
    assert torch.equal(w_scale, w_scale.half().float())  # stored as fp16 without loss
    assert torch.equal(qweight, torch.round(w / w_scale[:, None]).clamp(-127, 127).to(torch.int8))


def test_per_token_known_answer_with_ties():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, 127.0],  # amax 127: inv = 1, ties go to even
                      [0.5, -1.0, 0.25, 2.0, 1.0]])  # amax 2: inv = 63.5
    q, a_scale = quantize_act_per_token(x)
    assert q.dtype == torch.int8 and a_scale.dtype == torch.float32
    assert q[0].tolist() == [0, 2, 2, 0, 127]
    assert q[1].tolist() == [32, -64, 16, 127, 64]  # 31.75, -63.5, 15.875, 127, 63.5
    assert a_scale.tolist() == [1.0, pytest.approx(2 / 127)]


def test_per_token_uses_inverse_scale_multiply_in_fp32():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(2)).half()
    q, a_scale = quantize_act_per_token(x)
    amax = x.float().abs().amax(dim=1)
    inv = 127.0 / amax
    assert torch.equal(q, torch.round(x.float() * inv[:, None]).clamp(-127, 127).to(torch.int8))
    assert torch.equal(a_scale, amax / 127.0)


def test_static_clips_to_127_and_shares_one_scale():
    x = torch.tensor([[1.0, -3.0, 0.5], [10.0, -10.0, 0.0]])
    q, a_scale = quantize_act_static(x, 2.0)
    assert q.tolist() == [[64, -127, 32], [127, -127, 0]]  # 63.5 -> 64; beyond amax clips at +-127
    assert torch.equal(a_scale, torch.full((2,), 2.0) / 127)  # fp32 amax / 127, one value for every row
    with pytest.raises(ConfigError):
        quantize_act_static(x, 0.0)


def _codes(shape, seed):
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (17, 1024, 9), (5, 2500, 33)])
def test_int8_matmul_is_exact(m, k, n):
    q_x, qweight = _codes((m, k), 3), _codes((n, k), 4)
    want = q_x.double() @ qweight.double().T  # integer products and sums, exact in float64
    assert torch.equal(int8_matmul(q_x, qweight).double(), want)


def test_int8_matmul_exact_at_worst_case_magnitudes():
    k = 4000  # several fp32 chunks, every partial sum at its largest
    q_x = torch.full((2, k), -128, dtype=torch.int8)
    qweight = torch.stack([torch.full((k,), -128, dtype=torch.int8), torch.full((k,), 127, dtype=torch.int8)])
    acc = int8_matmul(q_x, qweight)
    assert acc.dtype == torch.int32
    assert acc[0].tolist() == [128 * 128 * k, -128 * 127 * k]


def test_int8_matmul_exact_when_fp32_matmul_may_round():
    q_x, qweight = _codes((9, 3000), 5), _codes((11, 3000), 6)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # allows bf16 inside fp32 matmuls: the float64 path must run
        acc = int8_matmul(q_x, qweight)
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(acc.double(), q_x.double() @ qweight.double().T)


def test_int8_matmul_matches_torch_int_mm_where_available():
    q_x, qweight = _codes((32, 64), 7), _codes((48, 64), 8)
    try:
        want = torch._int_mm(q_x, qweight.T.contiguous())
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"torch._int_mm not available on CPU: {e}")
    assert torch.equal(int8_matmul(q_x, qweight), want)


def test_int8_matmul_refuses_bad_operands():
    with pytest.raises(ConfigError, match="int8"):
        int8_matmul(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ConfigError, match="inner"):
        int8_matmul(_codes((2, 3), 0), _codes((2, 4), 0))
    with pytest.raises(ConfigError, match="overflow"):
        int8_matmul(torch.zeros(1, MAX_IN_FEATURES + 1, dtype=torch.int8),
                    torch.zeros(1, MAX_IN_FEATURES + 1, dtype=torch.int8))


def test_gemm_epilogue_order_and_dtype():
    q_x, qweight = _codes((4, 16), 9), _codes((6, 16), 10)
    a_scale = torch.rand(4, generator=torch.Generator().manual_seed(11)) + 0.01
    w_scale = torch.rand(6, generator=torch.Generator().manual_seed(12)) + 0.01
    y = int8_gemm_ref(q_x, qweight, a_scale, w_scale, torch.float16)
    acc = (q_x.double() @ qweight.double().T).float()
    want = ((acc * a_scale[:, None]) * w_scale[None, :]).half()
    assert y.dtype == torch.float16 and torch.equal(y, want)


def test_fake_quant_linear_is_close_to_float():
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(3, 5, 64, generator=g), torch.randn(32, 64, generator=g) / 8
    y = fake_quant_linear(x, w)
    exact = x @ w.T
    assert y.shape == (3, 5, 32)
    assert (y - exact).norm() / exact.norm() < 0.01


def test_int8_linear_follows_the_contract_step_by_step():
    g = torch.Generator().manual_seed(14)
    w, x = torch.randn(24, 40, generator=g), torch.randn(2, 3, 40, generator=g).half()
    for act, a_amax in ((ActQuant.DYNAMIC, None), (ActQuant.STATIC, 2.5)):
        lin = Int8Linear.from_dense(w, act, a_amax)
        assert isinstance(lin, Linear) and (lin.in_features, lin.out_features) == (40, 24)
        x2 = x.reshape(-1, 40)
        if act is ActQuant.DYNAMIC:
            amax = x2.float().abs().amax(dim=1)
        else:
            amax = torch.full((6,), 2.5)
        q = torch.round(x2.float() * (127 / amax)[:, None]).clamp(-127, 127)
        qw = torch.round(w / (w.abs().amax(dim=1) / 127)[:, None]).clamp(-127, 127)
        acc = (q.double() @ qw.double().T).float()
        want = ((acc * (amax / 127)[:, None]) * (w.abs().amax(dim=1) / 127)[None, :]).half()
        y = lin(x)
        assert y.dtype == torch.float16 and y.shape == (2, 3, 24)
        assert torch.equal(y.reshape(6, 24), want)


def test_int8_linear_dense_weight_to_and_nbytes():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(15))
    lin = Int8Linear.from_dense(w, ActQuant.STATIC, 3.0)
    assert lin.dense_weight().dtype == torch.float32
    assert torch.equal(lin.dense_weight(), lin.qweight.float() * lin.w_scale[:, None])
    half = lin.to(dtype=torch.float16)
    assert half.dense_weight().dtype == torch.float16 and half.qweight.dtype == torch.int8
    assert lin.nbytes() == 16 * 32 + 16 * 4 + 4
    with pytest.raises(ConfigError, match="a_amax"):
        Int8Linear(lin.qweight, lin.w_scale, ActQuant.STATIC, None)
    with pytest.raises(ConfigError, match="int8"):
        Int8Linear(w, lin.w_scale)
