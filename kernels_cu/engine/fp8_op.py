"""The engine's FP8 E4M3 W8A8 linear (model_zoo.quant.linear.Fp8Linear on the GPU), one op per fused group.

Each call quantizes its fp16 input (fp8_quantize: per token, or the checkpoint's static scale) and runs the GEMV up
to tuning.fp8_gemv_max_m rows or the wgmma GEMM above (fp8_gemm.py), so decode and prefill compute the CPU
reference's numerics. Up to tuning.fp8_xq_max_rows rows the GEMV quantizes its input itself, and after an RMSNorm
(norm_input: the layer hands it the norm's input) applies the norm too, with the same bits: a one-row layer is five
kernels, as int8's. A gate|up op with `swiglu` holds its weight interleaved by 8 and returns silu(gate) * up.
"""

from __future__ import annotations

import torch

from kernels_cu import tuning
from kernels_cu.fp8_gemm import NormIn, fp8_linear, fp8_linear_norm, norm_launch
from kernels_cu.fp8_quantize import FP8, require_fp8
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.swiglu_layout import gate_up_order
from model_zoo.errors import DeviceError
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear


class Fp8Op:
    """y = fp8_quantize(x) @ w8^T with the scales (+ residual); with `swiglu` silu(gate) * up [M, F]."""

    int8 = False  # the layer hands it fp16 activations (norm kernels, attention's fp16 output)

    def __init__(self, w8: torch.Tensor, w_scale: torch.Tensor, static_scale: torch.Tensor | None,
                 swiglu: bool = False):
        self.swiglu = swiglu and w8.shape[0] % 16 == 0
        if self.swiglu:  # rows (and scales) interleaved by 8, so one GEMV panel holds a gate and its up channel
            order = gate_up_order(w8.shape[0], w8.device)
            w8, w_scale = w8[order], w_scale[order]
        self.w8 = w8.contiguous().view(FP8)  # [N, K] e4m3 codes
        self.w_scale = w_scale.contiguous()  # [N] fp32
        self.static_scale = static_scale  # [1] fp32 for static activations, None for per-token dynamic

    def __call__(self, x: torch.Tensor | NormIn, residual: torch.Tensor | None = None,
                 fold_in: FoldIn | None = None, fold_out: FoldOut | None = None) -> torch.Tensor:
        if fold_in is not None or fold_out is not None:
            raise DeviceError("an fp8 linear takes no deferred RMSNorm")
        if isinstance(x, NormIn):
            if residual is not None:
                raise DeviceError("an fp8 linear after an RMSNorm takes no residual")
            return fp8_linear_norm(x, self.w8, self.w_scale, self.static_scale, self.swiglu)
        return fp8_linear(x, self.w8, self.w_scale, self.static_scale, residual, self.swiglu)

    def norm_input(self, h: torch.Tensor, w: torch.Tensor, eps: float) -> NormIn | None:
        """This op's input after the RMSNorm (weight w) of h [M, K] as a NormIn, which its GEMV normalizes and
        quantizes itself, up to tuning.fp8_xq_max_rows rows; None: run the norm kernel."""
        if h.dim() != 2 or h.shape[0] > tuning.current().fp8_xq_max_rows or norm_launch(h.shape[1]) is None:
            return None
        return NormIn(h, w, eps)

    def folds(self, m: int) -> bool:
        return False

    def nbytes(self) -> int:
        return self.w8.numel() + self.w_scale.numel() * 4


def fuse_fp8(linears: list[Fp8Linear], device: torch.device, swiglu: bool = False) -> Fp8Op:
    """One Fp8Op for Fp8Linears that read the same input (q|k|v, gate|up), concatenated along N."""
    require_fp8(device.index if device.index is not None else torch.cuda.current_device())
    # as bytes: concatenation and row gathers of float8 tensors are not in every torch build
    w8 = torch.cat([l.weight8.view(torch.uint8) for l in linears]).to(device)  # [sum N, K]
    w_scale = torch.cat([l.w_scale.float() for l in linears]).to(device)  # [sum N]
    static = linears[0].act == ActQuant.STATIC
    if any((l.act == ActQuant.STATIC) != static for l in linears) or (
            static and len({float(l.a_scale) for l in linears}) != 1):
        raise DeviceError("fused fp8 linears need one activation mode and one static scale")  # load unifies them
    scale = torch.tensor([float(linears[0].a_scale)], dtype=torch.float32, device=device) if static else None
    return Fp8Op(w8, w_scale, scale, swiglu=swiglu)
