"""int8_gemm (GEMV kernel for M <= 16 and for narrow outputs to tuning.int8_gemv_max_m, torch._int_mm + dequant kernel above) against the W8A8 contract.

The epilogue is the same two fp32 roundings as model_zoo.quant.int8.int8_gemm_ref, so an exact int32 product
shows as bitwise-equal fp16 outputs: every comparison here is assert_equal.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu.int8_gemm import SILU_SIGNATURE, XQ_SIGNATURE, int8_gemm, int8_gemm_ref  # noqa: E402
from model_zoo.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.gpu

KN = [(576, 1536), (1536, 576), (4096, 4096), (4096, 12288), (11008, 4096), (8192, 8192)]
MS = [1, 2, 7, 16, 17, 32, 33, 64, 512]


def codes(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8).cuda()


def scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 0.02 + 1e-3).cuda()  # fp32, positive


def run(M: int, K: int, N: int, seed: int, per_token: bool = True, residual: bool = False):
    q_x, qweight = codes(M, K, seed=seed), codes(N, K, seed=seed + 1)
    a_scale = scales(M if per_token else 1, seed + 2) * 0.1
    w_scale = scales(N, seed + 3) * 0.1
    res = randn(M, N, seed=seed + 4) if residual else None
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    int8_gemm(q_x, a_scale, qweight, w_scale, residual=res, out=y)
    return y, int8_gemm_ref(q_x, a_scale, qweight, w_scale, residual=res)


@pytest.mark.parametrize("K,N", KN)
@pytest.mark.parametrize("M", MS)
def test_exact_int32_then_contract_epilogue(M, K, N):
    y, ref = run(M, K, N, seed=M + K + N)
    assert bool(torch.isfinite(y).all())
    assert_equal(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [1, 9, 16, 40])
@pytest.mark.parametrize("K,N", [(48, 24), (576, 200), (1040, 36)])
def test_ragged_edges(M, K, N):
    """K not a multiple of the 64-wide tile, N not a multiple of 16 (and of 8: the GEMV path at any M)."""
    y, ref = run(M, K, N, seed=7 * M + N)
    assert_equal(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M", [1, 5, 16, 17, 300])
def test_static_per_tensor_scale(M):
    y, ref = run(M, 4096, 1536, seed=M, per_token=False)
    assert_equal(y, ref, f"static M={M}")


@pytest.mark.parametrize("M", [1, 8, 13, 16, 17, 32, 128])
def test_fused_residual(M):
    y, ref = run(M, 4096, 4096, seed=3 * M, residual=True)
    assert_equal(y, ref, f"residual M={M}")


def test_rejects_bad_inputs():
    q_x, qweight, w_scale = codes(2, 40, seed=1), codes(8, 40, seed=2), scales(8, 3)
    with pytest.raises(ConfigError, match="multiple of 16"):
        int8_gemm(q_x, scales(2, 4), qweight, w_scale)
    q_x, qweight = codes(2, 64, seed=1), codes(8, 64, seed=2)
    with pytest.raises(ValueError, match="a_scale"):
        int8_gemm(q_x, scales(3, 4), qweight, w_scale)
    with pytest.raises(ValueError, match="aligned"):
        int8_gemm(codes(136, seed=5)[8:].view(2, 64), scales(2, 4), qweight, w_scale)  # 8-byte offset


@pytest.mark.parametrize("cu,name,sig", [
    ("int8_gemm.cu", "int8_gemv_mt1", "PPPiPPPPPPPiii"), ("int8_gemm.cu", "int8_gemv_mt1_res", "PPPiPPPPPPPiii"),
    ("int8_gemm.cu", "int8_gemv_mt2", "PPPiPPPPPPPiii"), ("int8_gemm.cu", "int8_gemv_mt1_silu", SILU_SIGNATURE),
    ("int8_gemm.cu", "int8_gemv_xq_res", XQ_SIGNATURE), ("int8_gemm.cu", "int8_gemv_xq1_res", XQ_SIGNATURE),
    ("fp16_gemv.cu", "fp16_gemv_mt1", "PPPPiiiPPPPfi"),
    ("fp16_gemv.cu", "fp16_gemv_mt2_res", "PPPPiiiPPPPfi"), ("fp16_gemv.cu", "fp16_gemv_mt1_silu", "PPPPiiiPPPPfi")])
def test_gemv_ring_residency(cu, name, sig):
    """gemv_shared's shared memory: a one-wave grid gets exactly two blocks per SM (never three, which leaves SMs
    idle), a longer grid the ring alone, and the registers leave room for two blocks either way."""
    from kernels_cu import build
    from kernels_cu.gemm_shapes import GEMV_RING_BYTES, GEMV_THREADS, gemv_shared, gemv_xq_shared, sm_count, smem_per_sm

    res = build.get_function(cu, name, sig).resources()
    assert res["local_bytes"] == 0, res
    assert -(-res["registers"] // 8) * 8 * GEMV_THREADS * 2 <= 65536, res
    need = gemv_xq_shared(1, 4096) if "xq_" in name else GEMV_RING_BYTES  # xq1: the ring alone
    per_block = lambda dyn: dyn + res["shared_bytes"] + 1024  # the driver reserves 1 KB a block  # noqa: E731
    one_wave = gemv_shared(256, need, 0)
    assert 2 * per_block(one_wave) <= smem_per_sm(0) < 3 * per_block(one_wave), (res, one_wave)
    assert gemv_shared(2 * sm_count(0) + 1, need, 0) == need and 2 * per_block(need) <= smem_per_sm(0)
