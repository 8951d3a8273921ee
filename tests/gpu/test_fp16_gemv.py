"""fp16_gemv / fp16_linear against a float64 product rounded to fp16."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, check_swiglu, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.fp16_gemv import fp16_gemv, fp16_linear, fp16_linear_ref, fp16_swiglu, fp16_swiglu_ref  # noqa: E402
from kernels_cu.swiglu_layout import interleave_gate_up  # noqa: E402

pytestmark = pytest.mark.gpu

KN = [(576, 1536), (1536, 576), (4096, 4096), (4096, 12288), (11008, 4096), (8192, 8192), (40, 37)]


def check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert bool(torch.isfinite(y).all()), what
    rms = float(ref.float().pow(2).mean().sqrt())
    compare(y, ref, rtol=2e-3, atol=1e-3 * rms, what=what)
    rel = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-3, f"{what}: relative error {rel:.2e}"


@pytest.mark.parametrize("K,N", KN)
@pytest.mark.parametrize("M", [1, 2, 7, 8, 9, 16])
def test_gemv(M, K, N):
    x, w = randn(M, K, seed=M), randn(N, K, scale=0.05, seed=K + N)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    fp16_linear(x, w, out=y)
    check(y, fp16_linear_ref(x, w), f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [17, 33])
def test_gemv_kernel_beyond_16_rows(M):
    x, w = randn(M, 1536, seed=M), randn(576, 1536, scale=0.05, seed=1)
    check(fp16_gemv(x, w), fp16_linear_ref(x, w), f"M={M}")


@pytest.mark.parametrize("M", [17, 64, 512])
def test_linear_uses_cublas_above_16_rows(M):
    x, w = randn(M, 4096, seed=M), randn(4096, 4096, scale=0.05, seed=2)
    check(fp16_linear(x, w), fp16_linear_ref(x, w), f"M={M}")


@pytest.mark.parametrize("M", [1, 5, 16, 40])
def test_fused_residual(M):
    x, w, r = randn(M, 4096, seed=M), randn(11008, 4096, scale=0.05, seed=3), randn(M, 11008, seed=M + 9)
    check(fp16_linear(x, w, residual=r), fp16_linear_ref(x, w, residual=r), f"residual M={M}")


@pytest.mark.parametrize("K,F", [(576, 1536), (4096, 11008), (256, 40)])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
def test_swiglu_epilogue(M, K, F):
    """An interleaved gate|up weight: silu(gate) * up from the GEMV's epilogue (M <= 16) or cuBLAS + torch."""
    gate, up = randn(F, K, seed=F, scale=0.05), randn(F, K, seed=F + 1, scale=0.05)
    w = interleave_gate_up(torch.cat([gate, up]))  # [2F, K]
    x = randn(M, K, seed=M)
    y = torch.empty(M, F, dtype=torch.float16, device="cuda")
    poison(y)
    fp16_swiglu(x, w, out=y)
    # the same sums as the plain GEMV of [gate; up], then torch's fp16 SiLU and multiply
    g16, u16 = fp16_linear(x, gate), fp16_linear(x, up)
    compare(y, torch.nn.functional.silu(g16) * u16, rtol=2e-3, atol=1e-3 * float(u16.float().abs().mean()),
            what=f"M={M} K={K} F={F}")
    check_swiglu(y, g16, u16, fp16_swiglu_ref(x, w), f"M={M} K={K} F={F}")
