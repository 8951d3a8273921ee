"""fp16_gemv / fp16_linear, and w8a16_linear (int8 weights), against a float64 product rounded to fp16."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, check_swiglu, compare, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import tuning  # noqa: E402
from kernels_cu.fp16_gemv import (fp16_gemv, fp16_linear, fp16_linear_ref, fp16_swiglu, fp16_swiglu_ref,  # noqa: E402
                                  w8a16_linear, w8a16_linear_ref, w8a16_warps)
from kernels_cu.swiglu_layout import interleave_gate_up, swiglu_interleaved  # noqa: E402

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


@pytest.mark.parametrize("M", [1, 5, 16, 32, 40])
def test_fused_residual(M):
    """Beyond 16 rows cuBLAS adds the residual before its one rounding, where the reference rounds the product
    and then adds: at most half an fp16 ulp of the product plus one of the sum apart, which `check`'s tolerance
    holds (about half of it used, simulated on the CPU for these shapes)."""
    x, w, r = randn(M, 4096, seed=M), randn(11008, 4096, scale=0.05, seed=3), randn(M, 11008, seed=M + 9)
    check(fp16_linear(x, w, residual=r), fp16_linear_ref(x, w, residual=r), f"residual M={M}")


@pytest.mark.parametrize("K,N", [(4096, 4096), (2048, 2048), (11008, 4096), (40, 37)])
@pytest.mark.parametrize("M", [1, 7, 9, 16])
def test_settled_residual(M, K, N):
    """residual_settled: each epilogue thread reads its residual before the PDL wait; the same bits as reading it
    in the epilogue (both token tiles, a ragged N)."""
    x, w, r = randn(M, K, seed=M), randn(N, K, scale=0.05, seed=K + N), randn(M, N, seed=M + 9)
    y = fp16_gemv(x, w, residual=r)
    check(y, fp16_linear_ref(x, w, residual=r), f"residual M={M} K={K} N={N}")
    early = torch.empty_like(y)
    poison(early)
    assert_equal(fp16_gemv(x, w, residual=r, out=early, residual_settled=True), y, f"settled M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [17, 32, 100])
def test_cublas_residual_in_place(M):
    """The engine's form beyond 16 rows: out=residual (torch then skips copying the residual into a separate
    output before cuBLAS's beta = 1 epilogue). Same bits as a separate output, within the reference's tolerance.
    (On the H200 the error against the float64 sum equalled the two-step reference's, 0.423 vs 0.423 at
    M = 17: this cuBLAS kernel does not measurably round once instead of twice.)"""
    x, w, r = randn(M, 4096, seed=M), randn(11008, 4096, scale=0.05, seed=3), randn(M, 11008, seed=M + 9)
    y = torch.empty(M, 11008, dtype=torch.float16, device="cuda")
    poison(y)
    assert fp16_linear(x, w, residual=r, out=y) is y
    check(y, fp16_linear_ref(x, w, residual=r), f"residual M={M}")
    r2 = r.clone()
    assert fp16_linear(x, w, residual=r2, out=r2) is r2
    assert_equal(r2, y, f"in place M={M}")


@pytest.mark.parametrize("K,F", [(576, 1536), (4096, 11008), (256, 40)])
@pytest.mark.parametrize("M", [1, 5, 16, 17, 32, 40])
def test_swiglu_epilogue(M, K, F):
    """An interleaved gate|up weight: silu(gate) * up from the GEMV's epilogue (M <= 16) or cuBLAS and then
    silu_mul_interleaved."""
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


@pytest.mark.parametrize("M", [17, 32, 100])
def test_swiglu_beyond_16_rows_is_cublas_then_silu_mul_interleaved(M):
    """Bit for bit the torch ops it replaced: cuBLAS's product, then torch's fp16 SiLU and multiply."""
    gate, up = randn(11008, 4096, seed=4, scale=0.05), randn(11008, 4096, seed=5, scale=0.05)
    w = interleave_gate_up(torch.cat([gate, up]))  # [2F, K]
    x = randn(M, 4096, seed=M)
    want = swiglu_interleaved(torch.matmul(x, w.t()))  # [M, F]
    assert_equal(fp16_swiglu(x, w), want, f"M={M}")
    y = torch.empty(M, 11008, dtype=torch.float16, device="cuda")
    poison(y)
    assert fp16_swiglu(x, w, out=y) is y
    assert_equal(y, want, f"out= M={M}")
    check_swiglu(y, fp16_linear(x, gate), fp16_linear(x, up), fp16_swiglu_ref(x, w), f"vs reference M={M}")


def int8_head(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """model_zoo.quant.int8's per-channel codes and scales of a random fp16 weight, rows of different ranges."""
    from model_zoo.quant.int8 import quantize_weight_int8

    w = randn(N, K, scale=0.05, seed=seed) * torch.linspace(0.2, 3.0, N, device="cuda", dtype=torch.float16)[:, None]
    return quantize_weight_int8(w)


@pytest.mark.parametrize("K,N", [(576, 49152), (2048, 8200), (4096, 32000), (8192, 1024), (64, 40)])
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16, 17, 32, 33, 64])
def test_w8a16_gemv(M, K, N):
    """int8 codes with a scale per channel and fp16 activations, up to 64 rows on the GEMV: the float64 sums
    times the scale, rounded once; the same bits run to run."""
    q, s = int8_head(N, K, seed=K + N)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() == 127
    x = randn(M, K, seed=M)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    assert w8a16_linear(x, q, s, out=y) is y
    check(y, w8a16_linear_ref(x, q, s), f"M={M} K={K} N={N}")
    assert_equal(w8a16_linear(x, q, s), y, f"M={M} K={K} N={N}: run to run")


@pytest.mark.parametrize("K", [576, 2048, 3072])
def test_w8a16_gemv_four_and_eight_warps(K):
    """One token tile at short K runs 4-warp blocks (w8a16_warps); the 8-warp entry on the same shape is right
    too, and each is the same bits run to run."""
    q, s = int8_head(4104, K, seed=K)
    x = randn(3, K, seed=K)
    ref = w8a16_linear_ref(x, q, s)
    for max_k in (K, 0):
        with tuning.override(w8a16_four_warp_max_k=max_k):
            assert w8a16_warps(3, K) == (4 if max_k else 8)
            y = w8a16_linear(x, q, s)
            check(y, ref, f"K={K} max_k={max_k}")
            assert_equal(w8a16_linear(x, q, s), y, f"K={K} max_k={max_k}: run to run")


def check_cublas(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """cuBLAS's fp16 GEMM on the dequantized weight, as the fp16 head's prefill: its split-K partial sums are fp16
    (torch's reduced-precision reduction, the default), so a small output next to large partials can be off by a
    few fp16 ulps of the partials (H100: 0.031 on an output of rms 5.7, 2 of 165,000): the elements at 1% of the
    rms, the whole at 1e-3."""
    assert bool(torch.isfinite(y).all()), what
    rms = float(ref.float().pow(2).mean().sqrt())
    compare(y, ref, rtol=2e-3, atol=1e-2 * rms, what=what)
    rel = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-3, f"{what}: relative error {rel:.2e}"


@pytest.mark.parametrize("M", [65, 300])
def test_w8a16_above_64_rows_is_cublas_on_dequantized_chunks(M, monkeypatch):
    """Beyond the GEMV's rows each chunk of channels is dequantized to fp16 (one rounding of code * scale) for
    cuBLAS, with any chunk size."""
    import kernels_cu.fp16_gemv as mod

    q, s = int8_head(5000, 4096, seed=3)
    x = randn(M, 4096, seed=M)
    ref = w8a16_linear_ref(x, q, s)
    check_cublas(w8a16_linear(x, q, s), ref, f"M={M}")
    monkeypatch.setattr(mod, "W8A16_CHUNK_ROWS", 1024)
    check_cublas(w8a16_linear(x, q, s), ref, f"M={M}: chunks of 1,024")


def test_w8a16_checks_its_inputs():
    q, s = int8_head(64, 256, seed=1)
    x = randn(1, 256, seed=1)
    with pytest.raises(ValueError, match="int8"):
        w8a16_linear(x, q.half(), s)
    with pytest.raises(ValueError, match="K"):
        w8a16_linear(randn(1, 200, seed=1), int8_head(64, 200, seed=1)[0], s)
    with pytest.raises(ValueError, match="qweight"):
        w8a16_linear(x, q[:, :128], s)
