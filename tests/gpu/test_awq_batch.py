"""awq_batch.cu (the AWQ GEMM for decode batches) against the float64 reference, with and without K splits.

It reads the same packed layout as awq_gemv and sums in another order (warps own panels, not k tiles), so
it is held to the GEMV's tolerance against the float64 product of w_hat rounded to fp16, and to the GEMV
itself; the split path must be deterministic and leave its counters at zero.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, check_gemm, check_swiglu, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import awq_batch, build, counters  # noqa: E402
from kernels_cu.awq_gemv import awq_batch_gemm, awq_gemv, awq_linear, awq_linear_ref, pack_for_gemv  # noqa: E402
from kernels_cu.tuning import DEFAULT  # noqa: E402

BATCH_MIN_M, GEMV_MAX_M, WGMMA_DECODE_MIN_M = DEFAULT.awq_batch_min_m, DEFAULT.awq_gemv_max_m, DEFAULT.awq_wgmma_decode_min_m
from kernels_cu.gemm_shapes import cdiv  # noqa: E402

pytestmark = pytest.mark.gpu

# (K, N, G): SmolLM2 (K 576 padded to 5 tiles; groups of 64 / 32 / 192), LLaMA-2-7B q|k|v, o, down, odd tiles
SHAPES = [(576, 1536, 64), (1536, 576, 32), (576, 576, 192), (4096, 12288, 128), (4096, 4096, 128),
          (11008, 4096, 128), (2048, 1024, 128)]


def counters_are_zero() -> None:
    build.synchronize()
    for c in counters.pools(awq_batch.COUNTER_POOL):
        assert int(c.abs().sum()) == 0, "a split launch left a counter non-zero"


@pytest.mark.parametrize("K,N,G", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16, 17, 24, 32, 33, 64])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_batch_matches_reference(M, K, N, G, splits):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=M + K + N + G)
    p = pack_for_gemv(qweight, qzeros, scales)
    x = randn(M, K, seed=M)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    awq_batch_gemm(x, p, out=y, splits=splits)
    check_gemm(y, awq_linear_ref(x, p), f"M={M} K={K} N={N} G={G} splits={splits}")
    counters_are_zero()


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("M", [9, 30, 64])
def test_residual_and_swiglu(M, splits):
    qweight, qzeros, scales = awq_tensors(4096, 4096, 128, seed=M)
    p = pack_for_gemv(qweight, qzeros, scales)
    x, res = randn(M, 4096, seed=M), randn(M, 4096, seed=M + 1)
    check_gemm(awq_batch_gemm(x, p, residual=res, splits=splits), awq_linear_ref(x, p, residual=res),
               f"residual M={M} splits={splits}")
    F = 1408
    qweight, qzeros, scales = awq_tensors(4096, 2 * F, 128, seed=M + 7)
    gp = pack_for_gemv(qweight, qzeros, scales, swiglu=True)
    y = awq_batch_gemm(x, gp, splits=splits)  # [M, F]
    gu = awq_linear_ref(x, pack_for_gemv(qweight, qzeros, scales))  # [M, 2F], not interleaved
    check_swiglu(y, gu[:, :F], gu[:, F:], awq_linear_ref(x, gp), f"swiglu M={M} splits={splits}")
    counters_are_zero()


def test_agrees_with_the_gemv_and_is_deterministic():
    qweight, qzeros, scales = awq_tensors(11008, 4096, 128, seed=3)
    p = pack_for_gemv(qweight, qzeros, scales)
    for M in (8, 17, 32):
        x = randn(M, 11008, seed=M + 40)
        first = awq_batch_gemm(x, p, splits=5)
        check_gemm(first, awq_gemv(x, p), f"batch vs gemv M={M}")
        for _ in range(3):
            assert_equal(awq_batch_gemm(x, p, splits=5), first, f"run to run M={M}")
    counters_are_zero()


def test_awq_linear_dispatch():
    """awq_linear takes the batch kernel from BATCH_MIN_M to GEMV_MAX_M tokens where N % 64 == 0 (with groups of
    128 on Hopper only below WGMMA_DECODE_MIN_M: test_awq_wgmma_decode.py): the same bits as awq_batch_gemm with
    its default split (and the GEMV's below)."""
    for gs in (128, 64):
        qweight, qzeros, scales = awq_tensors(4096, 12288, gs, seed=11)
        p = pack_for_gemv(qweight, qzeros, scales)
        for M in (BATCH_MIN_M - 1, BATCH_MIN_M, GEMV_MAX_M):
            if gs == 128 and M >= WGMMA_DECODE_MIN_M and build.has_wgmma(torch.cuda.current_device()):
                continue
            x = randn(M, 4096, seed=M)
            want = awq_batch_gemm(x, p) if M >= BATCH_MIN_M else awq_gemv(x, p)
            assert_equal(awq_linear(x, p), want, f"dispatch M={M} groups of {gs}")


@pytest.mark.parametrize("mt", [1, 2, 4])
@pytest.mark.parametrize("gpt", [1, 2, 4])
@pytest.mark.parametrize("epi", ["plain", "res", "silu"])
def test_batch_resources(mt, gpt, epi):
    """No variant spills, and registers and shared memory leave the resident blocks it was capped for."""
    fn = build.get_function("awq_batch.cu", f"awq_batch_mt{mt}_g{gpt}_{epi}", "PPPPPPPiiiii")
    res = fn.resources()
    assert res["local_bytes"] == 0, res
    blocks = awq_batch.min_blocks(mt, gpt)
    per_thread = cdiv(res["registers"], 8) * 8
    assert per_thread * awq_batch.threads(mt) * blocks <= 65536, res
    props = torch.cuda.get_device_properties(0)
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
    per_block = awq_batch.STAGES * awq_batch.stage_bytes(mt, gpt) + res["shared_bytes"] + 1024
    assert blocks * per_block <= smem_sm, (per_block, smem_sm)
