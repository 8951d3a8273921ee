"""silu_mul.cu against F.silu(g) * u: fp16 within 2e-3 of float64, int8 variants bit for bit; the interleaved
entry point bit for bit against swiglu_layout.swiglu_interleaved and silu_mul."""

import pytest
import torch
from torch.nn.functional import silu as torch_silu

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.quantize import quantize_fold, quantize_ref  # noqa: E402
from kernels_cu.silu_mul import silu_mul, silu_mul_interleaved, silu_mul_quant, silu_mul_ref  # noqa: E402
from kernels_cu.swiglu_layout import gate_up_order, swiglu_interleaved  # noqa: E402

pytestmark = pytest.mark.gpu
FFN = [1536, 11008, 14336, 28672]
TOKENS = [1, 7, 33]
INTERLEAVED_M = [1, 17, 32, 100]  # decode GEMV's limit + 1, decode batch 32, an odd prefill
INTERLEAVED_F = [8, 688, 11008]  # one panel, 86 panels, llama-7B


@pytest.mark.parametrize("F", FFN)
@pytest.mark.parametrize("T", TOKENS)
def test_silu_mul(T, F):
    gate_up = randn(T, 2 * F, scale=3.0, seed=F + T)
    out = torch.empty(T, F, dtype=torch.float16, device="cuda")
    poison(out)
    silu_mul(gate_up, out=out)
    compare(out, silu_mul_ref(gate_up), rtol=2e-3, atol=1e-4, what="vs torch fp16")
    compare(out, silu_mul_ref(gate_up, torch.float64), rtol=2e-3, atol=1e-4, what="vs float64")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("F", FFN + [8, 1032])  # + one vector; a second block with one vector (silu_mul_part)
@pytest.mark.parametrize("T", TOKENS + [100])
def test_silu_mul_quant_is_bitwise(T, F, static, split):
    """One block per row or each row over several blocks (silu_mul_part + quantize_fold): quantize_ref's bits
    both ways, a row of zeros (amax clamped) included."""
    gate_up = randn(T, 2 * F, scale=3.0, seed=F * T + 1)
    gate_up[T // 2] = 0.0
    y = silu_mul(gate_up)
    amax = (y.float().abs().max() * 0.7).reshape(1) if static else None
    q = torch.empty(T, F, dtype=torch.int8, device="cuda")
    s = torch.empty(T, dtype=torch.float32, device="cuda")
    poison(q, s)
    silu_mul_quant(gate_up, static_amax=amax, q=q, a_scale=s, split=split)
    q_ref, s_ref = quantize_ref(y, amax)
    assert_equal(q, q_ref, "q")
    assert_equal(s, s_ref, "a_scale")


def test_silu_mul_quant_picks_the_split_for_few_rows(monkeypatch):
    from kernels_cu import silu_mul as mod
    from kernels_cu import tuning

    rows = tuning.DEFAULT.silu_split_max_rows
    gate_up = randn(rows, 2 * 1536, seed=3)
    calls = []
    monkeypatch.setattr(mod, "quantize_fold",
                        lambda *a, **k: calls.append(tuple(a[0].shape)) or quantize_fold(*a, **k))
    silu_mul_quant(gate_up)
    silu_mul_quant(randn(rows + 1, 2 * 1536, seed=4))
    with tuning.override(silu_split_max_rows=0):
        silu_mul_quant(gate_up)
    assert calls == [(rows, 1536)], calls  # only the first call went through the split


@pytest.mark.parametrize("F", INTERLEAVED_F)
@pytest.mark.parametrize("M", INTERLEAVED_M)
def test_silu_mul_interleaved_is_bitwise(M, F):
    """The same fp32 silu, fp16 rounding and fp16 multiply as torch's ops and as silu_mul on [gate | up]."""
    gate_up = randn(M, 2 * F, scale=3.0, seed=M * F + 2)  # [M, 2F] as [gate | up]
    y = interleaved(gate_up)  # [M, 2F]
    out = torch.empty(M, F, dtype=torch.float16, device="cuda")
    poison(out)
    assert silu_mul_interleaved(y, out=out) is out
    assert_equal(out, swiglu_interleaved(y), f"vs torch M={M} F={F}")
    assert_equal(out, silu_mul(gate_up), f"vs silu_mul M={M} F={F}")
    assert_equal(silu_mul_interleaved(y), out, "out=None")


def test_silu_mul_interleaved_extremes():
    """Zeros, fp16 subnormals, exp(-g) overflowing fp32 (g = -65504 gives -0), and products overflowing to inf."""
    g = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 6.1e-5, -6.1e-5, 0.5, -0.5, 11.0, -11.0, 17.5, -17.5, 88.5, -88.5,
                      65504.0, -65504.0], dtype=torch.float16)  # [16] gate values
    u = torch.tensor([1.0, -3.0, 65504.0, -65504.0, 2.0, 1e-3, 7.0, -7.0] * 2, dtype=torch.float16)  # [16]
    gate_up = torch.stack([torch.cat([g, u]), torch.cat([g.flip(0), u])]).cuda()  # [2, 32] as [gate | up]
    y = interleaved(gate_up)  # [2, 32]
    assert_equal(silu_mul_interleaved(y), swiglu_interleaved(y), "extremes")


def every_fp16(rows: int) -> torch.Tensor:
    """All 65,536 fp16 bit patterns (NaNs, infinities, zeros of both signs, subnormals) as [rows, 65536 / rows]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).cuda().view(rows, -1)


@pytest.mark.parametrize("unit_up", [True, False])
def test_silu_on_every_fp16_input(unit_up):
    """silu_fast.cuh (ex2 / rcp approximations, the bracket, silu_h where it straddles an fp16 boundary) against
    torch's fp16 F.silu, which rounds the same fp32 formula once, on every gate value: through the fp16 row
    (silu_mul) and the interleaved kernel; up = 1 gives silu(g) itself, random up the fp16 product."""
    gate = every_fp16(64)  # [64, 1024]
    up = torch.ones_like(gate) if unit_up else randn(*gate.shape, scale=3.0, seed=11)
    want = torch_silu(gate) * up  # [64, 1024]
    gate_up = torch.cat([gate, up], dim=1)  # [64, 2048]
    out = silu_mul(gate_up)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan), "NaN positions differ"
    for got, what in ((out, "silu_mul"), (silu_mul_interleaved(interleaved(gate_up)), "interleaved")):
        bad = (got.view(torch.int16) != want.view(torch.int16)) & ~nan
        assert int(bad.sum()) == 0, f"{what}: {int(bad.sum())} of 65536 differ, e.g. gate {gate[bad][:4].tolist()}"


def interleaved(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] columns [M, 2F] -> the interleaved order the SwiGLU kernels take (a copy)."""
    return gate_up[:, gate_up_order(gate_up.shape[1], gate_up.device)].contiguous()


def test_silu_mul_interleaved_empty_and_bad_arguments():
    assert silu_mul_interleaved(torch.empty(0, 32, dtype=torch.float16, device="cuda")).shape == (0, 16)
    y = randn(4, 32, seed=5)
    with pytest.raises(ValueError, match="out must have shape"):
        silu_mul_interleaved(y, out=torch.empty(4, 32, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="out must be torch.float16"):
        silu_mul_interleaved(y, out=torch.empty(4, 16, dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="16-byte aligned"):
        silu_mul_interleaved(randn(4 * 32 + 1, seed=6)[1:].view(4, 32))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul_interleaved(randn(4, 64, seed=7)[:, :32])
    with pytest.raises(ValueError, match="y must be torch.float16"):
        silu_mul_interleaved(y.float())
    with pytest.raises(ValueError, match="multiple of 16"):
        silu_mul_interleaved(randn(4, 24, seed=8))
    with pytest.raises(ValueError, match=r"\[M, 2F\]"):
        silu_mul_interleaved(randn(32, seed=9))
