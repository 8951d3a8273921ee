"""The engine's FP8 E4M3 W8A8 linear (model_zoo.quant.linear.Fp8Linear on the GPU), one op per fused group.

Each call quantizes its fp16 input (fp8_quantize: per token, or the checkpoint's static scale) and runs the GEMV up
to tuning.fp8_gemv_max_m rows or the wgmma GEMM above (fp8_gemm.py), so decode and prefill compute the CPU
reference's numerics. Up to tuning.fp8_xq_max_rows rows the GEMV quantizes its input itself, and after an RMSNorm
(norm_input: the layer hands it the norm's input) applies the norm too, with the same bits: a one-row layer is five
kernels, as int8's. A gate|up op with `swiglu` holds its weight interleaved by 8 and returns silu(gate) * up.

In a decode step whose plan defers (plan.py: the fp8 chain, up to tuning.fp8_defer_max_rows rows) the op takes int8's
deferred forms instead: a FoldQuant for q|k|v and gate|up (fold_input: the norm its producer deferred), a
DeferredQuant for o_proj and down_proj (the maxima that attention or the gate|up GEMV wrote), and o_proj / down_proj
write the next norm's FoldOut (fp8_gemm.py: quantized in the GEMV at one row, by fp8_quantize_fold beyond).

On Hopper each op makes its weight's TMA map at load, for the wgmma decode GEMM that fp8_gemm runs on the wide
products of 17-32 rows (fp8_wgmma_decode.py), so the decode graphs' captures make none.

Where the product runs on cuBLASLt (prefill; fp8_wgmma.library_runs) and tuning.fp8_fused_quant, the kernels around
it write what it takes: the RMSNorm its codes (norm_input: fp8_rmsnorm), the SwiGLU down_proj's codes (swiglu_for:
fp8_silu_mul), and o_proj / down_proj return a ResidualSum that the next norm's kernel adds in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kernels_cu import build, fp8_wgmma, fp8_wgmma_decode, tuning
from kernels_cu.fp8_gemm import (FoldQuant, NormIn, fp8_gemm, fp8_gemm_deferred, fp8_gemm_fold, fp8_linear,
                                  fp8_linear_norm, fp8_swiglu, norm_launch)
from kernels_cu.int8_gemm import DeferredQuant
from kernels_cu.fp8_quantize import FP8, fp8_quantize, fp8_rmsnorm, fp8_silu_mul, require_fp8
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.silu_mul import silu_mul
from kernels_cu.swiglu_layout import gate_up_order
from model_zoo.errors import DeviceError
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear


Codes = tuple  # (x8 float8_e4m3fn [M, K], a_scale fp32 [M]): an input a fused kernel quantized


@dataclass
class ResidualSum:
    """h + y, not added yet: an fp8 linear's product y fp16 [M, N] and the residual stream h [M, N] it adds to. The
    next RMSNorm's kernel adds it in place (fp8_rmsnorm with residual: h += y, torch.add's fp16 sum) and so saves a
    pass over the rows; `value()` adds it otherwise. Either way h holds the sum after, as cuBLAS's in-place residual
    leaves it for fp16 (the layer's stream is dead after its op)."""

    y: torch.Tensor
    h: torch.Tensor
    added: bool = field(default=False)

    @property
    def shape(self) -> torch.Size:
        return self.y.shape

    def value(self) -> torch.Tensor:
        """h + y [M, N] (h itself, added in place once)."""
        if not self.added:
            with build.on_stream():
                self.h.add_(self.y)
            self.added = True
        return self.h


class Fp8Op:
    """y = fp8_quantize(x) @ w8^T with the scales (+ residual); with `swiglu` silu(gate) * up [M, F]."""

    int8 = False  # the layer hands it fp16 activations (norm kernels, attention's fp16 output)
    fp8 = True  # plan.py's fp8 chain: takes FoldQuant / DeferredQuant inputs

    def __init__(self, w8: torch.Tensor, w_scale: torch.Tensor, static_scale: torch.Tensor | None,
                 swiglu: bool = False):
        self.swiglu = swiglu and w8.shape[0] % 16 == 0
        if self.swiglu:  # rows (and scales) interleaved by 8, so one GEMV panel holds a gate and its up channel
            order = gate_up_order(w8.shape[0], w8.device)
            w8, w_scale = w8[order], w_scale[order]
        self.w8 = w8.contiguous().view(FP8)  # [N, K] e4m3 codes
        self.w_scale = w_scale.contiguous()  # [N] fp32
        self.static_scale = static_scale  # [1] fp32 for static activations, None for per-token dynamic
        # the wgmma decode GEMM's weight map, made now: a map made inside the decode graph's capture would put a
        # put_map kernel before each launch and hold its weight copies behind the PDL wait
        w = self.w8
        mappable = w.shape[1] % 16 == 0 and w.data_ptr() % 16 == 0  # TMA: 16-byte rows and base
        hopper = w.is_cuda and build.has_wgmma(w.device.index or 0)
        self.decode_map = fp8_wgmma_decode.keep_weight_map(w) if hopper and mappable else None  # uint8 [128] or None

    def __call__(self, x: torch.Tensor | NormIn | FoldQuant | DeferredQuant, residual: torch.Tensor | None = None,
                 fold_in: FoldIn | None = None, fold_out: FoldOut | None = None) -> torch.Tensor:
        """fold_out: the next RMSNorm deferred in int8's format (with the residual); a deferred norm before this op
        arrives as a FoldQuant, never as fold_in."""
        if fold_in is not None:
            raise DeviceError("an fp8 linear takes its deferred RMSNorm as a FoldQuant")
        if isinstance(x, FoldQuant):
            if residual is not None or fold_out is not None:
                raise DeviceError("an fp8 linear after a deferred norm takes no residual")
            return fp8_gemm_fold(x, self.w8, self.w_scale, self.static_scale, self.swiglu)
        if isinstance(x, DeferredQuant) or fold_out is not None:  # static: the tensor itself, quantized by the scale
            dq = x if isinstance(x, DeferredQuant) else DeferredQuant(x, None)
            return fp8_gemm_deferred(dq, self.w8, self.w_scale, self.static_scale, residual, fold_out)
        if isinstance(x, NormIn):
            if residual is not None:
                raise DeviceError("an fp8 linear after an RMSNorm takes no residual")
            return fp8_linear_norm(x, self.w8, self.w_scale, self.static_scale, self.swiglu)
        defer_add = residual is not None and self._fused(x[0] if isinstance(x, tuple) else x)
        if defer_add and not isinstance(x, tuple):
            x = fp8_quantize(x, self.static_scale)
        if isinstance(x, tuple):  # codes a fused norm or SwiGLU kernel wrote
            if self.swiglu:
                return fp8_swiglu(x[0], x[1], self.w8, self.w_scale)
            if defer_add:
                return ResidualSum(fp8_gemm(x[0], x[1], self.w8, self.w_scale), residual)  # [M, N] + h
            return fp8_gemm(x[0], x[1], self.w8, self.w_scale, residual)
        return fp8_linear(x, self.w8, self.w_scale, self.static_scale, residual, self.swiglu)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the kernels around this op's product of x [M, K] write its codes and add its residual
        (tuning.fp8_fused_quant, where the product runs on cuBLASLt)."""
        return tuning.current().fp8_fused_quant and fp8_wgmma.library_runs(x, self.w8.shape[0])

    def fold_input(self, fold: FoldOut, eps: float, zero: torch.Tensor | None = None) -> FoldQuant:
        """This op's input after a norm its producer deferred in int8's format: zero, when given (one row), is
        cleared by its GEMV (a later gate|up's row max)."""
        return FoldQuant(fold.xg, fold.mx, fold.part, eps, zero)

    def swiglu_deferred(self, x: FoldQuant, row_amax: torch.Tensor | None = None) -> DeferredQuant:
        """gate|up of a deferred norm's rows: silu(gate) * up and its maxima per 8 channels (one row: also row_amax,
        zero on entry, the row's max) for a down_proj that quantizes it from them."""
        if not (self.swiglu and isinstance(x, FoldQuant)):
            raise DeviceError("the fp8 SwiGLU GEMV writes its maxima from a deferred norm's rows")
        return fp8_gemm_fold(x, self.w8, self.w_scale, self.static_scale, True, row_amax, maxima=True)

    def norm_input(self, h: torch.Tensor | ResidualSum, w: torch.Tensor, eps: float) -> NormIn | Codes | None:
        """This op's input after the RMSNorm (weight w) of h [M, K] (a ResidualSum: added here): a NormIn, which
        its GEMV normalizes and quantizes itself, up to tuning.fp8_xq_max_rows rows; beyond, with
        tuning.fp8_fused_quant, the codes of fp8_rmsnorm; None: run the norm kernel (on h, added)."""
        t = tuning.current()
        if h.shape[0] > t.fp8_xq_max_rows and t.fp8_fused_quant and len(h.shape) == 2:
            if not isinstance(h, ResidualSum) or h.added:
                return fp8_rmsnorm(h.h if isinstance(h, ResidualSum) else h, w, eps, self.static_scale)
            codes = fp8_rmsnorm(h.y, w, eps, self.static_scale, residual=h.h)  # h.h += h.y, then its norm's codes
            h.added = True
            return codes
        if isinstance(h, ResidualSum):
            h = h.value()
        if h.dim() != 2 or h.shape[0] > t.fp8_xq_max_rows or norm_launch(h.shape[1]) is None:
            return None
        return NormIn(h, w, eps)

    def swiglu_for(self, x: Any, down: "Fp8Op") -> torch.Tensor | Codes:
        """silu(gate) * up of this gate|up op's input x for the fp8 down_proj `down`: its codes (fp8_silu_mul at
        down's static scale, or per token) where x came as codes and the product runs on cuBLASLt, else fp16 [M, F]
        from the GEMV's or GEMM's SwiGLU epilogue (or silu_mul after a plain product)."""
        if self.swiglu and isinstance(x, tuple) and self._fused(x[0]):
            return fp8_silu_mul(fp8_gemm(x[0], x[1], self.w8, self.w_scale), down.static_scale)  # [M, 2F] -> [M, F]
        y = self(x)
        return y if self.swiglu else silu_mul(y)

    def folds(self, m: int) -> bool:
        return False

    def nbytes(self) -> int:
        return self.w8.numel() + self.w_scale.numel() * 4


def fuse_fp8(linears: list[Fp8Linear], device: torch.device, swiglu: bool = False) -> Fp8Op:
    """One Fp8Op for Fp8Linears that read the same input (q|k|v, gate|up), concatenated along N."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    require_fp8(index)
    if build.has_wgmma(index):
        fp8_wgmma.library_takes(index)  # probed now, not first inside a graph capture (which cannot probe)
    # as bytes: concatenation and row gathers of float8 tensors are not in every torch build
    w8 = torch.cat([l.weight8.view(torch.uint8) for l in linears]).to(device)  # [sum N, K]
    w_scale = torch.cat([l.w_scale.float() for l in linears]).to(device)  # [sum N]
    static = linears[0].act == ActQuant.STATIC
    if any((l.act == ActQuant.STATIC) != static for l in linears) or (
            static and len({float(l.a_scale) for l in linears}) != 1):
        raise DeviceError("fused fp8 linears need one activation mode and one static scale")  # load unifies them
    scale = torch.tensor([float(linears[0].a_scale)], dtype=torch.float32, device=device) if static else None
    return Fp8Op(w8, w_scale, scale, swiglu=swiglu)
