"""The int8 decode path with its quantizations deferred into the GEMVs (int8_gemm.DeferredQuant).

int8_swiglu (the gate|up GEMV with the SwiGLU in its epilogue) must give silu_mul's bits of the int8 GEMM's
output and row maxima that are the rows' maxima; int8_gemm_deferred (the GEMV that quantizes its own input)
must give int8_gemm(*quantize(x))'s bits. Every comparison is assert_equal.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.int8_gemm import (DeferredQuant, int8_gemm, int8_gemm_deferred, int8_gemm_ref,  # noqa: E402
                                  int8_swiglu)
from kernels_cu.quantize import quantize, quantize_ref  # noqa: E402
from kernels_cu.silu_mul import silu_mul  # noqa: E402

pytestmark = pytest.mark.gpu


def codes(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8).cuda()


def scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 0.02 + 1e-3).cuda()


def chunk_maxima(x: torch.Tensor, C: int) -> torch.Tensor:
    """part [M, C]: max |x| over C uneven slices of each row (as a producer's blocks would write them)."""
    M, K = x.shape
    edges = torch.linspace(0, K, C + 1).round().long().tolist()
    cols = [x[:, a:b].float().abs().amax(dim=1) if b > a else torch.zeros(M, device=x.device)
            for a, b in zip(edges, edges[1:])]
    return torch.stack(cols, dim=1).contiguous()  # [M, C]


@pytest.mark.parametrize("K,N", [(4096, 4096), (11008, 4096), (4096, 40), (64, 4096), (1040, 272)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("residual", [False, True])
def test_deferred_quantization_is_bitwise(M, K, N, residual):
    x = randn(M, K, scale=2.0, seed=K + N + M)
    x[M // 2, K // 3] = -9.5  # a clear row maximum away from the first slice
    if M > 2:
        x[1] = 0.0  # a row of zeros: amax clamped
    qweight, w_scale = codes(N, K, seed=M + 1), scales(N, seed=M + 2) * 0.1
    res = randn(M, N, seed=M + 3) if residual else None
    for C in (1, 32, max(1, K // 8)):
        y = torch.empty(M, N, dtype=torch.float16, device="cuda")
        poison(y)
        int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, C)), qweight, w_scale, residual=res, out=y)
        q, s = quantize_ref(x)
        assert_equal(y, int8_gemm_ref(q, s, qweight, w_scale, residual=res), f"M={M} K={K} N={N} C={C}")


@pytest.mark.parametrize("M", [1, 5])
def test_deferred_static_amax(M):
    K, N = 4096, 512
    x = randn(M, K, scale=2.0, seed=M)
    amax = torch.tensor([3.0], device="cuda")  # below the true max: values clamp to +-127
    qweight, w_scale = codes(N, K, seed=5), scales(N, seed=6) * 0.1
    y = int8_gemm_deferred(DeferredQuant(x, None, amax), qweight, w_scale)
    q, s = quantize_ref(x, amax)
    assert_equal(y, int8_gemm_ref(q, s, qweight, w_scale), f"static M={M}")


def test_deferred_beyond_the_kernel_rows_quantizes_first():
    M, K, N = 12, 1024, 256
    x = randn(M, K, seed=9)
    qweight, w_scale = codes(N, K, seed=10), scales(N, seed=11)
    y = int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, 4)), qweight, w_scale)
    assert_equal(y, int8_gemm(*quantize(x), qweight, w_scale), "12 rows")


@pytest.mark.parametrize("F,K", [(11008, 4096), (1536, 576), (8, 64), (688, 1040)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16])
def test_swiglu_epilogue_is_silu_mul_of_the_gemv(M, F, K):
    q_x, qweight = codes(M, K, seed=F + M), codes(2 * F, K, seed=F + 1)
    a_scale, w_scale = scales(M, seed=3) * 0.1, scales(2 * F, seed=4) * 0.1
    got = int8_swiglu(q_x, a_scale, qweight, w_scale)
    gate_up = int8_gemm(q_x, a_scale, qweight, w_scale)  # [M, 2F]: gate columns, then up
    want = silu_mul(gate_up)
    assert_equal(got.x, want, f"M={M} F={F} K={K}")
    assert got.part.shape == (M, F // 8)
    assert_equal(got.part, want.float().abs().reshape(M, F // 8, 8).amax(dim=2), "block maxima")


def test_swiglu_then_deferred_down_equals_the_quantized_chain():
    """The decode chain gate|up -> SwiGLU -> down as the engine runs it at one row, against the chain with
    silu_mul_quant: the same bits."""
    from kernels_cu.silu_mul import silu_mul_quant

    M, F, K = 1, 11008, 4096
    q_x, wgu = codes(M, K, seed=1), codes(2 * F, K, seed=2)
    a_scale, sgu = scales(M, seed=3) * 0.05, scales(2 * F, seed=4) * 0.05
    wd, sd = codes(K, F, seed=5), scales(K, seed=6) * 0.05
    h = randn(M, K, seed=7)
    got = int8_gemm_deferred(int8_swiglu(q_x, a_scale, wgu, sgu), wd, sd, residual=h)
    want = int8_gemm(*silu_mul_quant(int8_gemm(q_x, a_scale, wgu, sgu)), wd, sd, residual=h)
    assert_equal(got, want, "gate|up -> down")


def test_deferred_rejects_bad_inputs():
    x = randn(2, 64, seed=1)
    qweight, w_scale = codes(32, 64, seed=2), scales(32, seed=3)
    with pytest.raises(ValueError, match="partial maxima or a static amax"):
        int8_gemm_deferred(DeferredQuant(x, None), qweight, w_scale)
    with pytest.raises(ValueError, match="part must be"):
        int8_gemm_deferred(DeferredQuant(x, torch.zeros(3, 4, device="cuda")), qweight, w_scale)
    with pytest.raises(ValueError, match="K=64"):
        int8_gemm_deferred(DeferredQuant(x, chunk_maxima(x, 2)), codes(32, 48, seed=4), w_scale)
    with pytest.raises(ValueError, match="at most 16 rows"):
        int8_swiglu(codes(17, 64, seed=5), scales(17, seed=6), codes(32, 64, seed=7), scales(32, seed=8))
