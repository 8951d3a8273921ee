"""AWQ W4A16 linear layers (awq_gemm.cu) in AutoAWQ's GEMM layout, and their torch references.

    qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]   (model_zoo/quant/awq_pack.py)
    w_hat[k, n] = fp16((q - z) * s)      y = x @ w_hat with fp32 accumulation   (+ residual, an fp16 add)

M <= tuning.awq_gemm_max_m: awq_gemm kernel reading the packed weight directly (split over K, fp32 partials summed
by awq_reduce in a fixed order). Larger M: awq_dequant writes w_hat [K, N] and cuBLAS multiplies (vLLM
switches at 256 tokens; our small-M kernel re-reads the weight per 16 tokens, so it stops earlier).
Shapes the kernels do not take (N % 32, G % 16) fall back to the torch dequantizer.
"""

from __future__ import annotations

import torch

from model_zoo.quant.awq_pack import dequantize_awq
from kernels_cu import build, tuning
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.gemm_shapes import AWQ_WARPS, GEMV_THREADS, awq_launch, cdiv, sm_count



def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
             splits: int | None = None) -> torch.Tensor:
    """x fp16 [M, K] -> y fp16 [M, N]; `splits` overrides the K split of the small-M kernel (benchmarks)."""
    M, K, N, G = _check(x, qweight, qzeros, scales, residual)
    with build.on_stream():
        if M > tuning.current().awq_gemm_max_m or not kernels_take(N, G):
            y = torch.matmul(x, awq_dequantize(qweight, qzeros, scales), out=out)  # [M, N]
            return y if residual is None else y.add_(residual)
        y = out_or_new(out, (M, N), torch.float16, x, "out", align=8)
        if M == 0:
            return y
        launch = awq_launch(M, N, K, sm_count(x.device.index), splits)
        partial = torch.empty((launch.splits, M, N), dtype=torch.float32, device=x.device)  # [S, M, N]
        gemm = build.get_function("awq_gemm.cu", f"awq_gemm_mt{launch.mt}", "PPPPPiiiii")
        gemm(launch.grid(M, N), (32 * AWQ_WARPS,), partial, x, qweight, qzeros, scales, M, N, K, G,
             launch.tiles_per_warp)
        reduce = build.get_function("awq_gemm.cu", "awq_reduce_res" if residual is not None else "awq_reduce_plain",
                                    "PPPiii")
        reduce((cdiv(M * N // 4, GEMV_THREADS),), (GEMV_THREADS,), y, partial, residual, M, N, launch.splits)
    return y


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """w_hat fp16 [K, N] (the transpose of model_zoo.quant.awq_pack.dequantize_awq), bit for bit."""
    K, N = qweight.shape[0], scales.shape[1]
    G = K // max(1, scales.shape[0])
    with build.on_stream():
        if not kernels_take(N, G):
            w_hat = dequantize_awq(qweight, qzeros, scales, G, torch.float16).t()  # [K, N]
            return w_hat.contiguous() if out is None else out.copy_(w_hat)
        w_hat = out_or_new(out, (K, N), torch.float16, qweight, "out")
        if K:
            fn = build.get_function("awq_gemm.cu", "awq_dequant_kernel", "PPPPiii")
            fn((cdiv(K * (N // 32), GEMV_THREADS),), (GEMV_THREADS,), w_hat, qweight, qzeros, scales, N, K, G)
    return w_hat


def kernels_take(n: int, group_size: int) -> bool:
    """16-byte loads of 32 columns need N % 32 == 0; a 16-row k tile must not straddle groups."""
    return n % 32 == 0 and group_size % 16 == 0


def awq_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w_hat in float64, rounded once to fp16, then the fp16 residual add."""
    w_hat = awq_dequantize_ref(qweight, qzeros, scales)  # [K, N]
    y = (x.double() @ w_hat.double()).to(torch.float16)  # [M, N]
    return y if residual is None else y + residual


def awq_dequantize_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    K = qweight.shape[0]
    return dequantize_awq(qweight, qzeros, scales, K // scales.shape[0], torch.float16).t().contiguous()  # [K, N]


def _check(x, qweight, qzeros, scales, residual) -> tuple[int, int, int, int]:
    if x.dim() != 2 or qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise ValueError("x, qweight, qzeros and scales must be 2-D")
    M, K = x.shape
    N = scales.shape[1]
    groups = scales.shape[0]
    if groups == 0 or K % groups:
        raise ValueError(f"scales {tuple(scales.shape)} do not split K={K} into equal groups")
    if (tuple(qweight.shape) != (K, N // 8) or tuple(qzeros.shape) != (groups, N // 8) or N % 8):
        raise ValueError(f"AWQ tensors disagree: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    check_tensor(x, "x", torch.float16)
    check_tensor(qweight, "qweight", torch.int32)
    check_tensor(qzeros, "qzeros", torch.int32)
    check_tensor(scales, "scales", torch.float16)
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (M, N), align=8)
    return M, K, N, K // groups
