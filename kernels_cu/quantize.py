"""Per-token int8 quantization of an fp16 matrix (quantize.cu) and the rounding rule every int8 kernel shares.

The rule (dynamic per row, or static with one amax for the tensor):
    amax = max(max|x| over the row, 1e-8)     or  max(static_amax, 1e-8)
    q    = clamp(round_half_even(x * (127 / amax)), -127, 127)     int8, fp32 arithmetic, IEEE division
    a_scale[row] = amax / 127                                          fp32, written in both modes
so x ~= q * a_scale[row]. The kernels reproduce quantize_ref bit for bit.
"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_multiple, check_static_amax, check_tensor, out_or_new, row_launch

MIN_AMAX = 1e-8


def quantize_ref(x: torch.Tensor, static_amax: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype; fp16 values are used as they are) -> (q int8 [T, K], a_scale fp32 [T])."""
    x32 = x.float()
    if static_amax is None:
        amax = x32.abs().amax(dim=-1).clamp_min(MIN_AMAX)  # [T]
    else:
        a = torch.as_tensor(static_amax, dtype=torch.float32, device=x.device).reshape(())
        amax = a.clamp_min(MIN_AMAX).expand(x.shape[0])  # [T]
    # tensor / tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply
    c127 = torch.full_like(amax, 127.0)
    inv = c127 / amax  # [T] IEEE fp32 division, as the kernel's __fdiv_rn
    q = torch.round(x32 * inv[:, None]).clamp(-127, 127).to(torch.int8)  # [T, K]
    return q, amax / c127


def dequantize_ref(q: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    return q.float() * a_scale[:, None]  # [T, K]


def quantize(x: torch.Tensor, static_amax: torch.Tensor | None = None, q: torch.Tensor | None = None,
             a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 x [T, K] -> (q int8 [T, K], a_scale fp32 [T]); static_amax: fp32 tensor of one element on the GPU."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got shape {tuple(x.shape)}")
    T, K = x.shape
    check_multiple(K, 8, "the quantized width")
    check_tensor(x, "x", torch.float16)
    check_static_amax(static_amax)
    q = out_or_new(q, (T, K), torch.int8, x, "q", align=8)
    a_scale = out_or_new(a_scale, (T,), torch.float32, x, "a_scale", align=4)
    if T == 0:
        return q, a_scale
    nv, threads = row_launch(K // 8)
    mode = "dyn" if static_amax is None else "static"
    fn = build.get_function("quantize.cu", f"quantize_{mode}_nv{nv}", "PPPPi")
    fn((T,), (threads,), q, a_scale, static_amax, x, K)
    return q, a_scale


PARTS_VALUES = 128 * 8  # quantize_fold: 128 threads of 8 values a block
FOLD_SIGNATURE = "PPPPPPifiP"  # quantize_fold[_early]


def check_fold_inputs(xg: torch.Tensor, mx: torch.Tensor, sq: torch.Tensor | None,
                      static_amax: torch.Tensor | None, zero: torch.Tensor | None) -> tuple[int, int, int]:
    """quantize_fold's inputs (also what int8_gemm's one-row NormQuant GEMVs read) -> (T, K, C)."""
    if xg.dim() != 2:
        raise ValueError(f"xg must be [T, K], got shape {tuple(xg.shape)}")
    T, K = xg.shape
    check_multiple(K, 8, "the quantized width")
    check_tensor(xg, "xg", torch.float16)
    if mx.dim() != 2 or mx.shape[0] != T or mx.shape[1] == 0:
        raise ValueError(f"mx must be [{T}, C] with C > 0, got {tuple(mx.shape)}")
    C = mx.shape[1]
    check_tensor(mx, "mx", torch.float32, (T, C), align=4)
    if sq is not None:
        check_tensor(sq, "sq", torch.float32, (T, C), align=4)
    check_static_amax(static_amax)
    if zero is not None:
        check_tensor(zero, "zero", torch.float32, (T,), align=4)
    return T, K, C


def quantize_fold(xg: torch.Tensor, mx: torch.Tensor, sq: torch.Tensor | None, eps: float,
                  static_amax: torch.Tensor | None = None, q: torch.Tensor | None = None,
                  a_scale: torch.Tensor | None = None, early: bool = False,
                  zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized output of an RMSNorm deferred into an int8 producer (norm_fold.py): xg fp16 [T, K] = h * w,
    mx / sq fp32 [T, C] the maxima of |xg| and sums of h^2 over C channel groups -> (q int8 [T, K], a_scale fp32
    [T]) of rstd * xg, rstd = 1 / sqrt(sum(sq) / K + eps). Dynamic: xg's codes by its own max (quantize()'s bits
    of xg) and a_scale * rstd; static: the codes of rstd * xg by the static amax. sq None: no norm, quantize()'s
    bits of xg from its partial maxima (silu_mul_part's one per block, the int8 SwiGLU GEMV's one per 8 channels).
    q / a_scale: outputs to write, else new. early: under programmatic launch the next kernel may start before
    this one's wait, while the kernel before it still runs (quantize.cu EARLY): only where the next kernel is an
    int8 decode GEMV, which reads nothing but its weights before its own wait. zero fp32 [T]: set to 0 by the
    kernel (after its wait), for the next GEMV's row-max accumulator (int8_swiglu's row_amax)."""
    T, K, C = check_fold_inputs(xg, mx, sq, static_amax, zero)
    q = out_or_new(q, (T, K), torch.int8, xg, "q", align=8)  # [T, K]
    a_scale = out_or_new(a_scale, (T,), torch.float32, xg, "a_scale", align=4)  # [T]
    if T:
        fn = build.get_function("quantize.cu", "quantize_fold_early" if early else "quantize_fold", FOLD_SIGNATURE)
        fn((-(-K // PARTS_VALUES), T), (PARTS_VALUES // 8,), q, a_scale, mx, sq, static_amax, xg, K, float(eps), C,
           zero)
    return q, a_scale
