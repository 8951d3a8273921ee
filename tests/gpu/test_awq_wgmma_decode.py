"""awq_wgmma_decode.cu (the Hopper AWQ GEMM for decode batches of 17-64 tokens: w_hat in registers, wgmma n32 / n64,
x copied by a warp into a shared ring, K split over blocks) against float64 references.

As awq_wgmma.cu its w_hat is the reference dequantizer's bit for bit and its product an fp32 sum rounded once
(check_gemm). K splits sum their fp32 partials in split order: the result must not depend on which block finishes
last, so the same launch gives the same bits every time.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, check_gemm, check_swiglu, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import awq_wgmma_decode, build, counters  # noqa: E402
from kernels_cu.awq_gemv import awq_batch_gemm, awq_linear, awq_linear_ref, pack_for_gemv  # noqa: E402
from kernels_cu.tuning import DEFAULT  # noqa: E402

GEMV_MAX_M, WGMMA_DECODE_MIN_M = DEFAULT.awq_gemv_max_m, DEFAULT.awq_wgmma_decode_min_m

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())),
    reason="wgmma needs an sm_90 GPU")]


def run(M: int, K: int, N: int, seed: int, residual: bool = False, swiglu: bool = False,
        splits: int | None = None):
    """The kernel's output in a NaN-filled buffer with 8 spare rows (which must stay NaN), and the reference."""
    p = pack_for_gemv(*awq_tensors(K, N, 128, seed=seed), swiglu=swiglu)
    x = randn(M, K, seed=seed + 1)
    res = randn(M, N, seed=seed + 2) if residual else None
    big = torch.full((M + 8, p.out_features), float("nan"), dtype=torch.float16, device="cuda")
    y = awq_wgmma_decode.launch(x, p, res, big[:M], splits=splits)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    return y, awq_linear_ref(x, p, residual=res), x, p


@pytest.mark.parametrize("K,N", [(4096, 12288), (4096, 4096), (11008, 4096)])
@pytest.mark.parametrize("M", [17, 32, 33, 64])
def test_llama_shapes(M, K, N):
    """LLaMA-2-7B's q|k|v, o_proj and down_proj at both token tiles (n32 up to 32 rows, n64 above), with the
    launcher's own K splits (several for o / down)."""
    y, ref, _, _ = run(M, K, N, seed=M + K + N)
    check_gemm(y, ref, f"M={M} K={K} N={N}")
    torch.cuda.synchronize()
    assert not any(bool(c.any()) for c in counters.pools(awq_wgmma_decode.COUNTER_POOL)), "counters left non-zero"


@pytest.mark.parametrize("M,K,N,splits", [(20, 128, 64, 1), (31, 640, 192, 3), (40, 1152, 320, 4),
                                          (64, 384, 64, 3), (50, 896, 128, 2), (17, 4096, 256, 32)])
def test_ragged_and_forced_splits(M, K, N, splits):
    """Token counts that leave part of a token tile empty (zero-filled x rows), one tile per split, splits of
    unequal length (5 tiles in 3), a single block column."""
    y, ref, _, _ = run(M, K, N, seed=3 * M + N + splits, splits=splits)
    check_gemm(y, ref, f"M={M} K={K} N={N} splits={splits}")


@pytest.mark.parametrize("M,splits", [(24, 1), (48, 4)])
def test_fused_residual_in_place(M, splits):
    """The engine adds into the residual stream: y is the residual buffer."""
    p = pack_for_gemv(*awq_tensors(4096, 4096, 128, seed=M))
    x = randn(M, 4096, seed=M + 1)
    res = randn(M, 4096, seed=M + 2)
    ref = awq_linear_ref(x, p, residual=res)
    y = awq_wgmma_decode.launch(x, p, res, res, splits=splits)
    assert y.data_ptr() == res.data_ptr()
    check_gemm(y, ref, f"residual in place M={M} splits={splits}")


@pytest.mark.parametrize("M,F,splits", [(32, 11008, None), (57, 1536, 3)])
def test_swiglu_epilogue(M, F, splits):
    y, ref, x, p = run(M, 4096, 2 * F, seed=M + F, swiglu=True, splits=splits)
    gu = awq_linear_ref(x, pack_for_gemv(*awq_tensors(4096, 2 * F, 128, seed=M + F)))  # [M, 2F], not interleaved
    check_swiglu(y, gu[:, :F], gu[:, F:], ref, f"swiglu M={M} F={F}")


def test_splits_are_deterministic_and_replay_in_a_graph():
    """Eight K splits: the same bits on every eager launch and on every replay of a captured launch (the counters
    reset themselves), whichever block comes last."""
    p = pack_for_gemv(*awq_tensors(11008, 4096, 128, seed=5))
    x = randn(32, 11008, seed=6)
    first = awq_wgmma_decode.launch(x, p, None, None, splits=8)
    for _ in range(5):
        assert torch.equal(awq_wgmma_decode.launch(x, p, None, None, splits=8), first)
    out = torch.empty_like(first)
    stream = build.torch_stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        awq_wgmma_decode.launch(x, p, None, out, splits=8)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)



def test_awq_linear_takes_it_from_wgmma_decode_min_m():
    """awq_linear runs this kernel from WGMMA_DECODE_MIN_M to GEMV_MAX_M tokens with groups of 128 (the same bits as
    the launcher's default plan), awq_batch.cu below."""
    p = pack_for_gemv(*awq_tensors(4096, 12288, 128, seed=12))
    for M in (WGMMA_DECODE_MIN_M, GEMV_MAX_M):
        x = randn(M, 4096, seed=M)
        assert_equal(awq_linear(x, p), awq_wgmma_decode.launch(x, p, None, None), f"dispatch M={M}")
    x = randn(WGMMA_DECODE_MIN_M - 1, 4096, seed=1)
    assert_equal(awq_linear(x, p), awq_batch_gemm(x, p), "below WGMMA_DECODE_MIN_M")


@pytest.mark.parametrize("bt", [32, 64])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_resources(bt, epi):
    """No entry spills, and its registers leave the two resident blocks the kernel is capped for; two rings fit."""
    fn = build.get_function("awq_wgmma_decode.cu", f"awq_wgmma_decode_t{bt}_{epi}", "PPPPPPPiiiii")
    res = fn.resources()
    assert res["local_bytes"] == 0, res
    assert -(-res["registers"] // 8) * 8 * awq_wgmma_decode.THREADS * 2 <= 65536, res
    assert 2 * (awq_wgmma_decode.smem_bytes(bt) + res["shared_bytes"]) <= 227 * 1024
