"""W8A8 GEMM with the dequant epilogue (int8_gemm.cu), and its torch reference.

    acc[m, n] = sum_k q_x[m, k] * qweight[n, k]                       exact int32
    y[m, n]   = fp16((float(acc) * a_scale[m]) * w_scale[n])          (+ residual[m, n], an fp16 add)

M <= 16 (decode): int8_gemv, a memory-bound tensor-core kernel that reads each weight byte once.
On Hopper, where its grid fills the SMs: int8_wgmma.cu, a wgmma GEMM with the epilogue fused. Other M > 16:
torch._int_mm (cuBLASLt int8, needs M > 16 and K, N multiples of 8) and the dequant epilogue kernel.
a_scale holds one scale per token [M] or one for the tensor [1].
"""

from __future__ import annotations

import torch

from calibrate.int8 import int8_gemm_ref as _contract_gemm
from kernels_cu import build, int8_wgmma
from kernels_cu.checks import check_multiple, check_tensor, out_or_new
from kernels_cu.gemm_shapes import GEMV_THREADS, cdiv, gemv_grid, token_tile

DECODE_MAX_M = 16  # torch._int_mm refuses M <= 16; the GEMV kernel is the faster one there anyway


def int8_gemm(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
              residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              wgmma: bool | None = None) -> torch.Tensor:
    """q_x int8 [M, K], a_scale fp32 [M] or [1], qweight int8 [N, K], w_scale fp32 [N] -> y fp16 [M, N].

    wgmma: None chooses the kernel (int8_wgmma.takes); True forces int8_wgmma.cu at any M (tests, benchmarks:
    needs an sm_90 GPU and N % 8 == 0); False keeps it off."""
    M, K, N = _check(q_x, a_scale, qweight, w_scale, residual)
    if wgmma is None:
        wgmma = int8_wgmma.takes(q_x, N)
    elif wgmma and N % 8:
        raise ValueError(f"int8_wgmma needs N % 8 == 0, got N={N}")
    a_stride = 1 if a_scale.numel() == M else 0
    with build.on_stream():
        y = out_or_new(out, (M, N), torch.float16, q_x, "out", align=8)
        if M == 0 or N == 0:
            return y
        res = "_res" if residual is not None else ""
        if wgmma:
            int8_wgmma.launch(y, q_x, a_scale, a_stride, qweight, w_scale, residual)
        elif M > DECODE_MAX_M and N % 8 == 0:
            acc = torch._int_mm(q_x, qweight.t())  # [M, N] int32 (cuBLASLt, TN layout)
            fn = build.get_function("int8_gemm.cu", f"int8_dequant{res}", "PPPiPPii")
            fn((cdiv(M * N // 4, GEMV_THREADS),), (GEMV_THREADS,), y, acc, a_scale, a_stride, w_scale, residual, M, N)
        else:
            fn = build.get_function("int8_gemm.cu", f"int8_gemv_mt{token_tile(M)}{res}", "PPPiPPPiii")
            fn(gemv_grid(M, N), (GEMV_THREADS,), y, q_x, a_scale, a_stride, qweight, w_scale, residual, M, N, K)
    return y


def int8_gemm_ref(q_x: torch.Tensor, a_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """The contract in torch (calibrate.int8: exact int32 product, the same two fp32 roundings)."""
    a = a_scale.float().reshape(-1).expand(q_x.shape[0])  # [M]
    y = _contract_gemm(q_x, qweight, a, w_scale.float(), torch.float16)  # [M, N]
    return y if residual is None else y + residual


def _check(q_x, a_scale, qweight, w_scale, residual) -> tuple[int, int, int]:
    if q_x.dim() != 2 or qweight.dim() != 2:
        raise ValueError(f"q_x and qweight must be 2-D, got {tuple(q_x.shape)} and {tuple(qweight.shape)}")
    M, K = q_x.shape
    N = qweight.shape[0]
    if qweight.shape[1] != K:
        raise ValueError(f"q_x has K={K} but qweight is {tuple(qweight.shape)}")
    check_multiple(K, 16, "the int8 GEMM's K")
    check_tensor(q_x, "q_x", torch.int8)
    check_tensor(qweight, "qweight", torch.int8)
    if a_scale.numel() not in (M, 1):
        raise ValueError(f"a_scale must hold {M} per-token scales or 1 per-tensor scale, got {a_scale.numel()}")
    check_tensor(a_scale, "a_scale", torch.float32, align=4)
    check_tensor(w_scale, "w_scale", torch.float32, (N,), align=16)
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (M, N), align=8)
    return M, K, N
