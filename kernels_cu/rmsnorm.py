"""RMSNorm (rmsnorm.cu): plain, + int8 quantization (dynamic per token or static per tensor), and fused
with the residual add (residual += x in place, then the norm of the sum).

Numerics are transformers' LlamaRMSNorm: y = w * fp16(x32 * rsqrt(mean(x32^2) + eps)); the int8 variants
quantize y with quantize.quantize_ref's rule. One block per row, the row held in registers.
"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_multiple, check_static_amax, check_tensor, out_or_new, row_launch
from kernels_cu.quantize import quantize_ref

SIGNATURE = "PPPPPPPif"  # out, q, a_scale, static_amax, residual, x, w, H, eps


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """HF order with the statistics in `compute_dtype`; the roundings to x.dtype are kept where HF has them.
    With residual, the norm is of fp16(residual + x) (returned value only; nothing is modified)."""
    s = x if residual is None else residual + x  # [T, H] fp16 add, rounded as HF's
    s_hi = s.to(compute_dtype)
    rinv = torch.rsqrt(s_hi.pow(2).mean(-1, keepdim=True) + eps)  # [T, 1]
    return w * (s_hi * rinv).to(x.dtype)  # [T, H]


def rmsnorm_quant_ref(x: torch.Tensor, w: torch.Tensor, eps: float, static_amax=None,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_ref(rmsnorm_ref(x, w, eps, residual), static_amax)


def check_inputs(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> tuple[int, int]:
    """A norm's x [T, H] fp16 (H % 8 == 0), weight w [H] and residual [T, H] or None, on the GPU: (T, H)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    check_multiple(H, 8, "hidden size")
    check_tensor(x, "x", torch.float16)
    check_tensor(w, "w", torch.float16, (H,))
    if residual is not None:
        check_tensor(residual, "residual", torch.float16, (T, H))
    return T, H


def _launch(variant: str, T: int, H: int, eps: float, out=None, q=None, a_scale=None, static_amax=None,
            residual=None, x=None, w=None) -> None:
    if T == 0:
        return
    check_static_amax(static_amax)
    nv, threads = row_launch(H // 8)
    fn = build.get_function("rmsnorm.cu", f"rmsnorm_{variant}_nv{nv}", SIGNATURE)
    fn((T,), (threads,), out, q, a_scale, static_amax, residual, x, w, H, float(eps))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 x [T, H], w [H] -> fp16 [T, H]."""
    T, H = check_inputs(x, w, None)
    out = out_or_new(out, (T, H), torch.float16, x, "out")
    _launch("plain", T, H, eps, out=out, x=x, w=w)
    return out


def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float, static_amax: torch.Tensor | None = None,
                  q: torch.Tensor | None = None,
                  a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 x [T, H] -> (q int8 [T, H], a_scale fp32 [T]); dynamic per token unless static_amax is given."""
    T, H = check_inputs(x, w, None)
    q = out_or_new(q, (T, H), torch.int8, x, "q", align=8)
    a_scale = out_or_new(a_scale, (T,), torch.float32, x, "a_scale", align=4)
    _launch("dyn" if static_amax is None else "static", T, H, eps, q=q, a_scale=a_scale,
            static_amax=static_amax, x=x, w=w)
    return q, a_scale


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x (fp16, in place); returns rmsnorm(residual) * w as fp16 [T, H]."""
    T, H = check_inputs(x, w, residual)
    out = out_or_new(out, (T, H), torch.float16, x, "out")
    _launch("add", T, H, eps, out=out, residual=residual, x=x, w=w)
    return out


def add_rmsnorm_quant(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                      static_amax: torch.Tensor | None = None, q: torch.Tensor | None = None,
                      a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place); returns the int8 quantization of rmsnorm(residual) * w."""
    T, H = check_inputs(x, w, residual)
    q = out_or_new(q, (T, H), torch.int8, x, "q", align=8)
    a_scale = out_or_new(a_scale, (T,), torch.float32, x, "a_scale", align=4)
    _launch("add_dyn" if static_amax is None else "add_static", T, H, eps, q=q, a_scale=a_scale,
            static_amax=static_amax, residual=residual, x=x, w=w)
    return q, a_scale
