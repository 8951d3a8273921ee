"""awq_gemm / awq_dequantize against the AutoAWQ-layout reference (model_zoo.quant.awq_pack.dequantize_awq).

The dequantizer must match bit for bit (same fp16 product); the GEMM is compared with a float64 product
of the same w_hat, rounded to fp16.
"""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, check_gemm, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from model_zoo.quant.awq_pack import quantize_awq  # noqa: E402
from kernels_cu.awq_gemm import awq_dequantize, awq_dequantize_ref, awq_gemm, awq_gemm_ref  # noqa: E402
from kernels_cu.tuning import DEFAULT  # noqa: E402

GEMV_MAX_M = DEFAULT.awq_gemm_max_m

pytestmark = pytest.mark.gpu

# (K, N, G): hidden 576 takes groups of 32 / 64 / 192; LLaMA-2-7B shapes with 128.
SHAPES = [(576, 1536, 64), (1536, 576, 32), (576, 576, 192), (4096, 4096, 128), (4096, 12288, 128),
          (11008, 4096, 128), (4096, 1024, 32)]


@pytest.mark.parametrize("K,N,G", SHAPES)
def test_dequantize_is_bitwise(K, N, G):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=K + N + G)
    w_hat = torch.empty(K, N, dtype=torch.float16, device="cuda")
    poison(w_hat)
    awq_dequantize(qweight, qzeros, scales, out=w_hat)
    assert_equal(w_hat, awq_dequantize_ref(qweight, qzeros, scales), f"K={K} N={N} G={G}")


@pytest.mark.parametrize("K,N,G", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 7, 16, 17, 64, 65, 300])
def test_gemm_matches_reference(M, K, N, G):
    qweight, qzeros, scales = awq_tensors(K, N, G, seed=M + K + N + G)
    x = randn(M, K, seed=M)
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    poison(y)
    awq_gemm(x, qweight, qzeros, scales, out=y)
    check_gemm(y, awq_gemm_ref(x, qweight, qzeros, scales), f"M={M} K={K} N={N} G={G}")


@pytest.mark.parametrize("M", [1, 9, 16, 40])
def test_fused_residual(M):
    qweight, qzeros, scales = awq_tensors(4096, 4096, 128, seed=M)
    x, res = randn(M, 4096, seed=M), randn(M, 4096, seed=M + 1)
    y = awq_gemm(x, qweight, qzeros, scales, residual=res)
    check_gemm(y, awq_gemm_ref(x, qweight, qzeros, scales, residual=res), f"residual M={M}")


@pytest.mark.parametrize("splits", [1, 3, 8, 64])
def test_any_k_split_gives_the_same_answer(splits):
    qweight, qzeros, scales = awq_tensors(2048, 2048, 64, seed=splits)
    x = randn(5, 2048, seed=splits)
    y = awq_gemm(x, qweight, qzeros, scales, splits=splits)
    check_gemm(y, awq_gemm_ref(x, qweight, qzeros, scales), f"splits={splits}")


def test_small_m_path_agrees_with_dequantize_path():
    qweight, qzeros, scales = awq_tensors(4096, 2048, 128, seed=11)
    x = randn(GEMV_MAX_M, 4096, seed=12)
    y = awq_gemm(x, qweight, qzeros, scales)  # small-M kernel (M == GEMV_MAX_M)
    y_big = torch.matmul(x, awq_dequantize(qweight, qzeros, scales))  # the M > GEMV_MAX_M path
    check_gemm(y, y_big, "kernel vs dequantize + cuBLAS")


def test_real_quantizer_output():
    """Tensors made by calibrate's quantizer (realistic zeros and scales) from a float weight."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1536, 576, generator=g) * 0.05  # [N, K]
    qweight, qzeros, scales = (t.cuda() for t in quantize_awq(w, 64))
    x = randn(3, 576, seed=6)
    y = awq_gemm(x, qweight, qzeros, scales)
    check_gemm(y, awq_gemm_ref(x, qweight, qzeros, scales), "quantize_awq output")
    # and close to the float weight it came from (int4 error, not a kernel error)
    dense = (x.double() @ w.double().t().cuda()).float()
    assert float((y.float() - dense).norm() / dense.norm()) < 0.15


def test_fallback_shapes():
    """N % 32 != 0 goes through the torch dequantizer: same answer."""
    qweight, qzeros, scales = awq_tensors(256, 200, 64, seed=9)
    x = randn(4, 256, seed=10)
    check_gemm(awq_gemm(x, qweight, qzeros, scales), awq_gemm_ref(x, qweight, qzeros, scales), "N=200")
