"""The linear ops of the CPU backend (model_zoo/cpu_fast.py): the linears that read one input, fused into one op
and laid out once, at load, for the CPU kernel that runs them fastest with their Linear's numerics.

- float weights kept in fp16 (CpuDtype.FP16, the default): packed for FBGEMM's fp16 GEMM where this torch has it
  (x86 builds; PackedFp16Op: the weights rounded to fp16 once, x and the sums in fp32); elsewhere torch's fp16
  GEMV for one row (DenseOp). Weights past fp16's range stay fp32.
- float weights in fp32: the layout MKL's batch-1 GEMV reads fastest (DenseOp); AWQ weights dequantized into the
  weight dtype, as AwqLinear computes them.
- int8 codes kept as codes (model_zoo/cpu_int8.py: FBGEMM's or torch._int_mm's exact sums) with
  model_zoo.quant.int8's activation codes and fp32 epilogue: each output Int8Linear's bit for bit.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from model_zoo.cpu_int8 import int8_products
from model_zoo.linear import DenseLinear, Linear
from model_zoo.quant.awq_pack import dequantize_awq
from model_zoo.quant.fp8 import fp8_linear_ref
from model_zoo.quant.int8 import AMAX_MIN, QMAX, ActQuant, act_codes, dequant_epilogue
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear

# One linear of the fast path: x [M, K] -> y [M, N] (N = the fused outputs of its group).
Op = Callable[[torch.Tensor], torch.Tensor]

FP16_MAX = 65504.0  # the largest finite fp16


def fbgemm_fp16() -> bool:
    """Whether this torch has FBGEMM's fp16-weight GEMM (torch.ops.quantized.linear_dynamic_fp16; x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def dense_op(weights: Sequence[torch.Tensor], dtype: torch.dtype, x_dtype: torch.dtype = torch.float32) -> Op:
    """One op for float weights [N_i, K] kept in `dtype`, read by activations of `x_dtype`: packed for FBGEMM when
    fp16 weights meet fp32 activations there; fp32 where a weight does not fit fp16 (fp16 would change it)."""
    if dtype == torch.float16 and x_dtype == torch.float32:
        if not all(bool(w.abs().max() <= FP16_MAX) for w in weights):  # past fp16 (or NaN): the reference's fp32
            return DenseOp(weights, torch.float32)
        if fbgemm_fp16():
            return PackedFp16Op(weights)
    return DenseOp(weights, dtype)


class PackedFp16Op:
    """Float weights [N_i, K] of one group, fused, rounded to fp16 (as .half() rounds them) and packed for FBGEMM's
    fp16 GEMM: x stays fp32, the sums are fp32, y [M, N] fp32: the fp16 weights' products to fp32 rounding, at any
    rows. SmolLM2's 30 layers at one row, one thread: 9.4 ms against 13.3 in torch's fp16 GEMV (which rounds x and
    y to fp16 too); its lm_head 1.9 ms against 3.5; 64 rows 136 ms against 180 widening to fp32 GEMMs."""

    halves = False  # fp32 outputs: no fp16 overflow to recompute (CpuModel)

    def __init__(self, weights: Sequence[torch.Tensor]):
        w = torch.cat([w.float() for w in weights])  # [N, K]
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)  # fp16 [N, K], FBGEMM blocks

    def __call__(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)  # [M, N] fp32

    def weight(self) -> torch.Tensor:
        """The packed weights as fp32 [N, K] (for tests)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]


class DenseOp:
    """Float weights [N_i, K] of one group, fused: y = x @ W^T.

    fp32: stored as W^T [K, N] when N >= K (MKL's batch-1 sweep over K rows of N is then ~2x its N dot products
    of length K), as W [N, K] otherwise (there the dot products win: 1536 -> 576 down 6.7 vs 8.7 ms, 30 layers).
    fp16 (`halves`, where FBGEMM is not): W [N, K]. One row runs torch's fp16 GEMV (fp32 accumulation, x and the
    output rounded to fp16); several rows, or `upcast`, fp32 GEMMs of the same values widened a block of rows at
    a time (torch's fp16 GEMM is ~4x slower than fp32 at 64 rows)."""

    def __init__(self, weights: Sequence[torch.Tensor], dtype: torch.dtype):
        w = torch.cat([w.to(dtype) for w in weights])  # [N, K]
        self.halves = dtype == torch.float16
        self.transposed = not self.halves and w.shape[0] >= w.shape[1]
        self.w = w.T.contiguous() if self.transposed else w.contiguous()  # [K, N] or [N, K]

    def __call__(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        if self.halves and (upcast or x.shape[0] > 1):
            return self._widened(x)
        x = x.to(self.w.dtype)
        return x @ self.w if self.transposed else F.linear(x, self.w)  # [M, N] in the weight's dtype

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T in x's dtype, W widened _WIDEN_BLOCK elements at a time: each block is multiplied while
        it is in cache (SmolLM2, 4 rows: 54 ms a forward, 125 widening whole weights, 82 with fp32 weights)."""
        rows = max(1, _WIDEN_BLOCK // self.w.shape[1])
        parts = [F.linear(x, block.to(x.dtype)) for block in self.w.split(rows)]  # [M, rows] each
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [M, N]


_WIDEN_BLOCK = 1 << 19  # weights widened at a time: 2 MB of fp32, still in cache when it is multiplied


class Int8Op:
    """Int8Linears of one group sharing their activation quantization: codes [N, K] int8 (int8_products), w_scale
    fp32 [N].

    One fp32 row (a decode step) takes its scales as Python floats holding fp32 values: the same codes and
    outputs as act_codes / dequant_epilogue, bit for bit, in 7 small ops instead of 14."""

    def __init__(self, linears: Sequence[Int8Linear]):
        self.products = int8_products(torch.cat([lin.qweight for lin in linears]))  # codes [N, K]
        self.w_scale = torch.cat([lin.w_scale for lin in linears])  # [N]
        self.act, self.a_amax = linears[0].act, linears[0].a_amax
        self.static = None  # (inv, a_scale) of a static range, as act_codes computes them in fp32
        if self.act is ActQuant.STATIC:
            _, a_scale = act_codes(torch.zeros(1, 1), self.act, self.a_amax)  # checks the range once, here
            amax = torch.tensor(self.a_amax, dtype=torch.float32).clamp(min=AMAX_MIN)
            self.static = float(QMAX / amax), float(a_scale[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.dtype == torch.float32:
            return self._row(x)
        q, a_scale = act_codes(x, self.act, self.a_amax)  # [M, K] exact integers in fp32, [M]
        return dequant_epilogue(self.products(q), a_scale, self.w_scale, x.dtype)  # [M, N]

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        if self.static is None:
            amax = max(_abs_max(x), _F32_AMAX_MIN)
            inv, a_scale = _f32(QMAX / amax), _f32(amax / QMAX)  # fp32 quotients: a double one rounded once
            q = torch.mul(x, inv, out=self.products.row()).round_()  # [1, K]; |q| <= 127: no clamp needed
        else:
            inv, a_scale = self.static
            q = torch.mul(x, inv, out=self.products.row()).round_().clamp_(-QMAX, QMAX)  # [1, K]
        return self._product(q, a_scale)

    def normed_row(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(cpu_fast._row_norm(x, weight, eps)) for one fp32 row, the norm's 1 / rms folded into the activation
        scale: 3 small ops fewer; the codes equal the normalized row's up to fp32 rounding (fp16 mode only)."""
        r = rms_inv(x, eps)
        h = torch.mul(x, weight)  # [1, K]: the normalized row / r
        if self.static is None:
            amax = max(_abs_max(h) * r, AMAX_MIN)  # the normalized row's
            q = torch.mul(h, _f32(QMAX / amax * r), out=self.products.row()).round_()  # [1, K], |q| <= 127
            return self._product(q, _f32(amax / QMAX))
        inv, a_scale = self.static
        q = torch.mul(h, _f32(inv * r), out=self.products.row()).round_().clamp_(-QMAX, QMAX)  # [1, K]
        return self._product(q, a_scale)

    def _product(self, q: torch.Tensor, a_scale: float) -> torch.Tensor:
        """Codes q [1, K] (integers in fp32) -> (float(q @ codes^T) * a_scale) * w_scale, [1, N] fp32."""
        return torch.mul(self.products(q), a_scale).mul_(self.w_scale)  # [1, N]


def _abs_max(x: torch.Tensor) -> float:
    """max |x| of one row [1, K] (the inf-norm's value, in a third of its time)."""
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def _f32(v: float) -> float:
    """v rounded to fp32 (a Python float multiplies an fp32 tensor as this fp32 value)."""
    return struct.unpack("f", struct.pack("f", v))[0]


_F32_AMAX_MIN = _f32(AMAX_MIN)  # the clamp act_codes applies in fp32


class Fp8Op:
    """Fp8Linears of one group sharing their activation scale: e4m3 codes held (exactly) in fp32 [N, K], w_scale
    fp32 [N]; activation codes and epilogue are model_zoo.quant.fp8's, as Fp8Linear computes them."""

    def __init__(self, linears: Sequence[Fp8Linear]):
        self.codes = torch.cat([lin.weight8.float() for lin in linears])  # [N, K]
        self.w_scale = torch.cat([lin.w_scale for lin in linears])  # [N]
        self.act, self.a_scale = linears[0].act, linears[0].a_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear_ref(x, self.codes, self.w_scale, self.act, self.a_scale)  # [M, N]


class SplitOp:
    """Linears that cannot share one weight (mixed kinds or activation ranges): each alone, outputs joined."""

    def __init__(self, ops: Sequence[Op]):
        self.ops = list(ops)
        self.halves = any(getattr(op, "halves", False) for op in self.ops)

    def __call__(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        return torch.cat([apply_op(op, x, upcast).to(x.dtype) for op in self.ops], dim=-1)  # [M, sum N_i]


def apply_op(op: Op, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    """op(x); with `upcast`, ops holding fp16 weights compute in x's dtype (the overflow fallback, CpuModel)."""
    return op(x, upcast=True) if upcast and getattr(op, "halves", False) else op(x)


class ForeignOp:
    """A Linear of a kind this module does not lay out: called as it is (its own numerics)."""

    def __init__(self, linear: Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _float_weight(lin: Linear, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight [N, K] a float-compute linear multiplies by, or None for int8 / unknown kinds."""
    if isinstance(lin, DenseLinear):
        return lin.weight
    if isinstance(lin, AwqLinear):  # what AwqLinear.__call__ computes for x in `dtype`, made once here
        return dequantize_awq(lin.qweight, lin.qzeros, lin.scales, lin.group_size, dtype)  # [N, K]
    return None


def _int8_key(lin: Linear) -> tuple[ActQuant, float | None] | None:
    return (lin.act, lin.a_amax) if isinstance(lin, Int8Linear) else None


def make_op(linears: Sequence[Linear], dtype: torch.dtype, x_dtype: torch.dtype = torch.float32) -> Op:
    """One op for linears that read the same input (of `x_dtype`), float weights kept in `dtype`: fused where
    their numerics allow, else side by side."""
    floats = [_float_weight(lin, dtype) for lin in linears]
    if all(w is not None for w in floats):
        return dense_op(floats, dtype, x_dtype)
    keys = {_int8_key(lin) for lin in linears}
    if None not in keys and len(keys) == 1:
        return Int8Op(linears)
    fp8 = {(lin.act, lin.a_scale) if isinstance(lin, Fp8Linear) else None for lin in linears}
    if None not in fp8 and len(fp8) == 1:
        return Fp8Op(linears)
    if len(linears) > 1:
        return SplitOp([make_op([lin], dtype, x_dtype) for lin in linears])
    return ForeignOp(linears[0])


def rms_inv(x: torch.Tensor, eps: float) -> float:
    """1 / sqrt(mean(x^2) + eps) of one row [1, H], from its dot product with itself: one small op."""
    row = x.view(-1)  # [H]
    return (float(torch.dot(row, row)) / row.shape[0] + eps) ** -0.5
