"""The decoder layer on the GPU, for prefill and decode alike (ARCHITECTURE.md, "Engine"):

    RMSNorm (+ int8 quantization) -> q|k|v -> attend (RoPE, K/V write, attention) -> o_proj + residual
    -> RMSNorm (+ quant) -> gate|up -> SiLU(gate) * up (+ quant) -> down_proj + residual

A StepPlan (plan.py) says which of these a decode step defers into its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kernels_cu.engine.cache import GpuCache
from kernels_cu.engine.fp8_op import ResidualSum
from kernels_cu.engine.linears import fuse
from kernels_cu.engine.plan import StepPlan
from kernels_cu.int8_gemm import NormQuant, norm_in_loop
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.quantize import quantize, quantize_fold
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_quant
from kernels_cu.silu_mul import silu_mul, silu_mul_quant
from kernels_cu.tuning import Tuning
from model_zoo.errors import DeviceError

# attend(i, qkv [T, (nh + 2 nkv) d]) -> [T, nh * d], or (q int8, a_scale) / DeferredQuant for an int8 o_proj
Attend = Callable[[int, torch.Tensor], Any]


@dataclass
class GpuLayer:
    attn_norm: torch.Tensor  # [H] fp16
    ffn_norm: torch.Tensor  # [H] fp16
    qkv: Any  # H -> (n_heads + 2 n_kv) * head_dim
    o: Any
    gate_up: Any  # H -> 2F
    down: Any

    @classmethod
    def upload(cls, l: Any, dev: torch.device) -> "GpuLayer":
        """model_zoo's LayerWeights on the GPU, q|k|v and gate|up fused."""
        down = fuse([l.w_down], dev)
        # an int8 down_proj takes its input quantized by silu_mul_quant, so its gate|up applies no SwiGLU itself
        return cls(attn_norm=l.attn_norm.to(dev, torch.float16).contiguous(),
                   ffn_norm=l.ffn_norm.to(dev, torch.float16).contiguous(),
                   qkv=fuse([l.wq, l.wk, l.wv], dev), o=fuse([l.wo], dev),
                   gate_up=fuse([l.w_gate, l.w_up], dev, swiglu=not down.int8), down=down)

    def nbytes(self) -> int:
        return (self.attn_norm.numel() + self.ffn_norm.numel()) * 2 + sum(
            op.nbytes() for op in (self.qkv, self.o, self.gate_up, self.down))


def early_fold(rows: int, t: Tuning) -> bool:
    """Whether a quantize_fold of `rows` rows lets the int8 GEMV after it launch before its own wait."""
    return rows <= t.quant_fold_early_rows


def norm_in(h: torch.Tensor, w: torch.Tensor, op: Any, fold: FoldOut | None, eps: float, t: Tuning,
            zero: torch.Tensor | None = None) -> tuple[Any, FoldIn | None]:
    """op's input after the RMSNorm with weight w and how op takes it: the norm kernel's output (+ int8
    quantization for an int8 op) and None, or, when a producer deferred this norm (fold), its xg and FoldIn
    (for an int8 op: a NormQuant, which op's GEMV quantizes at one row and quantize_fold otherwise, and None;
    zero: a buffer the quantizing kernel clears, for a later GEMV). h may be an fp8 ResidualSum, which an fp8 op's
    norm kernel adds in place (engine/fp8_op.py)."""
    if fold is not None and fold.int8:  # xg quantized from the producer's maxima and sums (no norm kernel)
        by_fold = getattr(op, "fold_input", None)  # fp8 (engine/fp8_op.py): its GEMV takes the partials itself
        if by_fold is not None:
            return by_fold(fold, eps, zero), None
        nq = NormQuant(fold.xg, fold.mx, fold.part, eps, op.amax, zero, early=early_fold(h.shape[0], t))
        return (nq if nq.in_loop() else nq.quantized()), None
    if zero is not None:
        raise DeviceError("a row-max buffer is cleared by the int8 deferred norm's quantization only")
    if fold is not None:
        return fold.xg, fold.consumer(eps)
    by_op = getattr(op, "norm_input", None)  # fp8 (engine/fp8_op.py): the GEMV may apply the norm itself
    if by_op is not None and (x := by_op(h, w, eps)) is not None:
        return x, None
    h = _added(h)
    return (rmsnorm_quant(h, w, eps, op.amax) if op.int8 else rmsnorm(h, w, eps)), None


def run_layer(layers: list[GpuLayer], final_norm: torch.Tensor, i: int, h: torch.Tensor, cache: GpuCache,
              attend: Attend, plan: StepPlan, fold: FoldOut | None, eps: float,
              t: Tuning) -> tuple[torch.Tensor, FoldOut | None]:
    """Layer i: h [T, H] fp16 -> (h [T, H], the norm deferred after it or None); between two fp8 layers h may be
    a ResidualSum (engine/fp8_op.py), added by the next layer's norm kernel; the last layer returns it added.

    fold: h's deferred attn_norm (a folding decode step). The layer then defers its ffn_norm too and returns the
    next norm deferred (the next layer's attn_norm, or the final norm; int8's final norm stays a kernel)."""
    L, T = layers[i], h.shape[0]
    # [T] the SwiGLU GEMV's row maxima, cleared by the kernel that quantizes a norm before it: the quantize_fold
    # before gate|up, or where the GEMVs quantize one row's norm themselves (a GEMV cannot clear what its own
    # blocks accumulate), q|k|v
    row_amax = cache.static["row_amax"] if plan.row_amax else None
    # an fp8 gate|up GEMV always takes its norm's row itself, so its row max is cleared before it, by q|k|v
    qkv_clears = row_amax is not None and (norm_in_loop(T) or getattr(L.qkv, "fp8", False))
    x, fold_in = norm_in(h, L.attn_norm, L.qkv, fold, eps, t, zero=row_amax if qkv_clears else None)
    h = _added(h)
    qkv = L.qkv(x, fold_in=fold_in)  # [T, (nh + 2 nkv) d]
    o = attend(i, qkv)  # [T, nh * d], (q int8, a_scale) when attention quantized its output, or DeferredQuant
    if L.o.int8 and isinstance(o, torch.Tensor):
        o = quantize(o, L.o.amax)
    folding = fold is not None or plan.int8_fold
    ffn = FoldOut.new(L.ffn_norm, T, plan.int8_fold) if folding else None
    h = L.o(o, residual=h, fold_out=ffn)  # [T, H], or an fp8 ResidualSum that the norm's kernel adds
    x, fold_in = norm_in(h, L.ffn_norm, L.gate_up, ffn, eps, t, zero=None if qkv_clears else row_amax)
    h = _added(h)
    a = _swiglu(L, x, fold_in, plan, row_amax, t, T)
    nxt = None
    last = i + 1 == len(layers)
    if folding and not (plan.int8_fold and last):
        nxt = FoldOut.new(final_norm if last else layers[i + 1].attn_norm, T, plan.int8_fold)
    out = L.down(a, residual=h, fold_out=nxt)  # [T, H] (a ResidualSum for the next layer's norm kernel to add)
    return (_added(out) if last else out), nxt


def _added(h: torch.Tensor | ResidualSum) -> torch.Tensor:
    """The residual stream [T, H] once its pending fp8 residual add is done (by the norm kernel, or here)."""
    return h.value() if isinstance(h, ResidualSum) else h


def _swiglu(L: GpuLayer, x: Any, fold_in: FoldIn | None, plan: StepPlan, row_amax: torch.Tensor | None,
            t: Tuning, T: int) -> Any:
    """silu(gate) * up [T, F] of gate|up's input x in the form down_proj takes it (fp16, quantized, DeferredQuant)."""
    if plan.defer_down:
        return L.gate_up.swiglu_deferred(x, row_amax)  # DeferredQuant: silu(gate) * up and its row maxima
    if getattr(L.gate_up, "fp8", False) and getattr(L.down, "fp8", False):
        return L.gate_up.swiglu_for(x, L.down)  # down_proj's codes where a kernel quantizes the SwiGLU, else fp16
    if L.gate_up.swiglu:
        return L.gate_up(x, fold_in=fold_in)  # the GEMV's epilogue applied silu(gate) * up
    if L.gate_up.int8 and L.down.int8 and T <= t.swiglu_int8_rows:
        d = L.gate_up.swiglu_deferred(x)  # the GEMV's SwiGLU epilogue and its maxima per 8 channels
        return quantize_fold(d.x, d.part, None, 0.0, L.down.amax, early=early_fold(T, t))  # silu_mul_quant's bits
    gu = L.gate_up(x, fold_in=fold_in)  # [T, 2F]
    return silu_mul_quant(gu, L.down.amax) if L.down.int8 else silu_mul(gu)  # [T, F]
