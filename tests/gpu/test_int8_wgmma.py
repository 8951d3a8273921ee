"""int8_wgmma.cu (the Hopper prefill GEMM with the fused epilogue) against the W8A8 contract, bit for bit.

Every comparison is assert_equal: the int32 product is exact and the epilogue rounds as the reference.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import build, int8_wgmma  # noqa: E402
from kernels_cu.int8_gemm import int8_gemm, int8_gemm_ref  # noqa: E402
from tests.gpu.test_int8_gemm import codes, scales  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and build.has_wgmma(torch.cuda.current_device())),
    reason="wgmma needs an sm_90 GPU")]


def run(M: int, K: int, N: int, seed: int, per_token: bool = True, residual: bool = False, extreme: bool = False):
    """The kernel's output inside a poisoned buffer with 8 spare rows (which must stay poisoned), and the reference."""
    q_x, qweight = codes(M, K, seed=seed), codes(N, K, seed=seed + 1)
    if extreme:  # the largest |int32| sums the contract allows: every product 127 * 127 or -127 * 127
        q_x = torch.full_like(q_x, 127)
        qweight = torch.where(torch.rand(N, 1, device="cuda") < 0.5, 127, -127).to(torch.int8).expand(N, K).contiguous()
    a_scale = scales(M if per_token else 1, seed + 2) * (1e-4 if extreme else 0.1)
    w_scale = scales(N, seed + 3) * (1e-4 if extreme else 0.1)
    res = randn(M, N, seed=seed + 4) if residual else None
    big = torch.empty(M + 8, N, dtype=torch.float16, device="cuda")
    poison(big)
    int8_gemm(q_x, a_scale, qweight, w_scale, residual=res, out=big[:M], wgmma=True)
    assert bool(torch.isnan(big[M:]).all()), "rows past M were written"
    return big[:M], int8_gemm_ref(q_x, a_scale, qweight, w_scale, residual=res)


@pytest.mark.parametrize("K,N", [(4096, 12288), (4096, 4096), (11008, 4096), (4096, 22016), (576, 1536)])
@pytest.mark.parametrize("M", [128, 2048])
def test_llama_shapes_bitwise(M, K, N):
    y, ref = run(M, K, N, seed=M + K + N)
    assert_equal(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("M,K,N", [(1, 128, 256), (17, 48, 24), (129, 1040, 200), (300, 576, 960), (255, 4112, 264)])
def test_ragged_tiles(M, K, N):
    """M, N and K not multiples of the 128 x 256 x 128 tile (K = 48: one partial stage)."""
    y, ref = run(M, K, N, seed=5 * M + N)
    assert_equal(y, ref, f"M={M} K={K} N={N}")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_epilogue_variants(per_token, residual):
    y, ref = run(384, 4096, 1024, seed=11, per_token=per_token, residual=residual)
    assert_equal(y, ref, f"per_token={per_token} residual={residual}")


def test_extreme_sums_stay_exact():
    y, ref = run(256, 11008, 512, seed=3, extreme=True)
    assert bool(torch.isfinite(y).all())
    assert_equal(y, ref, "extreme")


def test_int8_gemm_takes_it_where_the_grid_fills_the_sms():
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    q_x, qweight, w_scale = codes(2048, 1024, seed=1), codes(4096, 1024, seed=2), scales(4096, 3)
    assert int8_wgmma.takes(q_x, 4096)  # 16 x 16 blocks
    assert not int8_wgmma.takes(q_x[:128], 4096)  # 1 x 16
    assert int8_wgmma.takes(q_x[:128], 256 * sms) and not int8_wgmma.takes(q_x[:128], 256 * (sms - 1))
    a_scale = scales(2048, 4) * 0.1
    y = int8_gemm(q_x, a_scale, qweight, w_scale * 0.1)
    assert_equal(y, int8_gemm_ref(q_x, a_scale, qweight, w_scale * 0.1), "dispatch")
