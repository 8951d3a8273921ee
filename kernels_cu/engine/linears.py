"""The engine's linears, one class per scheme, each choosing its kernel by the rows it gets.

fuse() builds one op for linears that read the same input (q|k|v, gate|up), concatenated along N.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_cu.awq_gemm import awq_gemm
from kernels_cu.awq_gemv import awq_linear, gemv_takes, pack_for_gemv
from kernels_cu.awq_gemv import folds as awq_folds
from kernels_cu.engine.fp8_op import fuse_fp8
from kernels_cu.fp16_gemv import DECODE_MAX_M, fp16_linear, fp16_swiglu
from kernels_cu.int8_gemm import (DeferredQuant, NormQuant, int8_gemm, int8_gemm_deferred, int8_gemm_norm,
                                  int8_swiglu, int8_swiglu_norm)
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.swiglu_layout import interleave_gate_up
from kernels_cu import tuning
from model_zoo.errors import DeviceError
from model_zoo.linear import DenseLinear
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear


class Fp16Op:
    """y = x @ W^T (+ residual): GEMV kernel up to 16 rows, cuBLAS above. With `swiglu` W is a gate|up
    weight interleaved by 8 and the op returns silu(gate) * up [M, F] (the GEMV's epilogue does it).
    fold_in / fold_out: the deferred RMSNorm (norm_fold.py), where `folds`."""

    int8 = False

    def __init__(self, weight: torch.Tensor, swiglu: bool = False):
        self.swiglu = swiglu and weight.shape[0] % 16 == 0
        self.weight = interleave_gate_up(weight) if self.swiglu else weight  # [N, K] fp16

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, fold_in: FoldIn | None = None,
                 fold_out: FoldOut | None = None) -> torch.Tensor:
        """residual: the layer's residual stream, whose writer (the o_proj / down_proj before, or the embedding) has
        at least q|k|v and attention, or gate|up, launched after it: settled, so a GEMV reads it before its PDL
        wait (AwqOp likewise)."""
        if self.swiglu:
            return fp16_swiglu(x, self.weight, fold_in=fold_in)
        # Beyond the GEMV's rows cuBLAS adds the residual in its epilogue only when writing over it (torch
        # copies it to a separate output first): the layer's residual stream is dead after this op.
        out = residual if residual is not None and x.shape[0] > DECODE_MAX_M else None
        return fp16_linear(x, self.weight, residual, out, fold_in, fold_out, residual_settled=True)

    def folds(self, m: int) -> bool:
        return m <= DECODE_MAX_M

    def nbytes(self) -> int:
        return self.weight.numel() * 2


class AwqOp:
    """y = x @ dequant(W)^T (+ residual). Repacked once into the GEMV layout (awq_layout.py) where its kernels take
    the shape (then a gate|up op with `swiglu` returns silu(gate) * up itself); else AutoAWQ's GEMM layout."""

    int8 = False

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, swiglu: bool = False):
        K, N = qweight.shape[0], scales.shape[1]  # qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]
        self.packed = (pack_for_gemv(qweight, qzeros, scales, swiglu=swiglu)
                       if gemv_takes(K, N, K // scales.shape[0]) else None)
        self.swiglu = swiglu and self.packed is not None
        self.awq = None if self.packed is not None else (qweight, qzeros, scales)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, fold_in: FoldIn | None = None,
                 fold_out: FoldOut | None = None) -> torch.Tensor:
        if self.packed is not None:
            # Beyond the GEMV's rows the product goes through a GEMM that adds the residual in place, as for
            # Fp16Op: the layer's residual stream is dead after this op.
            big = x.shape[0] > tuning.current().awq_gemv_max_m
            out = residual if residual is not None and big else None
            return awq_linear(x, self.packed, residual, out, fold_in, fold_out, residual_settled=True)
        if fold_in is not None or fold_out is not None:
            raise DeviceError("the deferred RMSNorm needs the AWQ GEMV layout")
        return awq_gemm(x, *self.awq, residual)

    def folds(self, m: int) -> bool:
        return self.packed is not None and awq_folds(self.packed, m)

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes()
        return sum(t.numel() * t.element_size() for t in self.awq)


class Int8Op:
    """y = (q_x @ Wq^T) * a_scale * w_scale (+ residual); takes the (q_x, a_scale) its producer made, or a
    DeferredQuant (fp16 x and its row maxima) that the GEMV quantizes itself."""

    int8 = True
    swiglu = False  # its down_proj takes the SwiGLU output quantized: silu_mul_quant, or swiglu_deferred

    def __init__(self, qweight: torch.Tensor, w_scale: torch.Tensor, amax: torch.Tensor | None):
        self.qweight, self.w_scale = qweight, w_scale  # [N, K] int8, [N] fp32
        self.amax = amax  # [1] fp32 for static activations, None for per-token dynamic

    def __call__(self, xq: tuple[torch.Tensor, torch.Tensor] | DeferredQuant | NormQuant,
                 residual: torch.Tensor | None = None, fold_in: FoldIn | None = None,
                 fold_out: FoldOut | None = None) -> torch.Tensor:
        """fold_out: the next RMSNorm deferred (a decode GEMV with a residual); a deferred RMSNorm before this op
        arrives as a NormQuant (or quantized by quantize_fold), never as fold_in. residual: the layer's residual
        stream, settled as Fp16Op's says."""
        if fold_in is not None:
            raise DeviceError("an int8 linear takes its deferred RMSNorm as a NormQuant or quantized")
        if isinstance(xq, NormQuant):
            if residual is not None or fold_out is not None:
                raise DeviceError("an int8 linear after a deferred norm takes no residual")
            return int8_gemm_norm(xq, self.qweight, self.w_scale)
        if isinstance(xq, DeferredQuant):
            return int8_gemm_deferred(xq, self.qweight, self.w_scale, residual, fold_out=fold_out,
                                      residual_settled=True)
        return int8_gemm(xq[0], xq[1], self.qweight, self.w_scale, residual, fold_out=fold_out)

    def swiglu_deferred(self, xq: tuple[torch.Tensor, torch.Tensor] | NormQuant,
                        row_amax: torch.Tensor | None = None) -> DeferredQuant:
        """A gate|up op (gate rows, then up rows) on a few rows: silu(gate) * up in fp16 with its row maxima,
        for a down_proj that quantizes its input itself (row_amax: int8_swiglu's)."""
        if isinstance(xq, NormQuant):
            return int8_swiglu_norm(xq, self.qweight, self.w_scale, row_amax)
        return int8_swiglu(xq[0], xq[1], self.qweight, self.w_scale, row_amax)

    def folds(self, m: int) -> bool:
        return False

    def nbytes(self) -> int:
        return self.qweight.numel() + self.w_scale.numel() * 4


def fuse(linears: list, device: torch.device, swiglu: bool = False) -> Any:
    """One GPU op for linears that read the same input (q|k|v, gate|up), concatenated along N; `swiglu`
    lets an op that can (fp16, AWQ, fp8) apply silu(gate) * up itself."""
    first = linears[0]
    if isinstance(first, Int8Linear):
        qweight = torch.cat([l.qweight for l in linears]).to(device)  # [sum N, K]
        w_scale = torch.cat([l.w_scale.float() for l in linears]).to(device)  # [sum N]
        static = first.act == ActQuant.STATIC
        if static and len({float(l.a_amax) for l in linears}) != 1:
            raise DeviceError("fused int8 linears need one static activation scale")  # load_quantized_weights unifies
        amax = torch.tensor([float(first.a_amax)], dtype=torch.float32, device=device) if static else None
        return Int8Op(qweight.contiguous(), w_scale.contiguous(), amax)
    if isinstance(first, Fp8Linear):
        return fuse_fp8(linears, device, swiglu=swiglu)  # engine/fp8_op.py: Fp8Op
    if isinstance(first, AwqLinear):
        qweight = torch.cat([l.qweight for l in linears], dim=1).to(device)  # [K, sum N / 8]
        qzeros = torch.cat([l.qzeros for l in linears], dim=1).to(device)  # [K/G, sum N / 8]
        scales = torch.cat([l.scales for l in linears], dim=1).to(device, torch.float16)  # [K/G, sum N]
        return AwqOp(qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), swiglu=swiglu)
    if isinstance(first, DenseLinear):
        w = torch.cat([l.dense_weight() for l in linears]).to(device, torch.float16)  # [sum N, K]
        return Fp16Op(w.contiguous(), swiglu=swiglu)
    raise DeviceError(getattr(first, "gpu_refusal", None)  # a linear that says why the kernels cannot take it
                      or f"the GPU engine cannot run linears of type {type(first).__name__}")
