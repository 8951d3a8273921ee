"""The CPU backend: the reference model's math (model_zoo/reference.py), laid out for decoding on a CPU.

At a 135M model's size a decode step is ~0.27 GFLOP: what costs is reading the weights and the per-op overhead,
so whatever can be done once is done at load (and counted as load, not as the first prefill):
- float weights kept in fp16 by default (CpuDtype; `--cpu-dtype fp32` keeps the reference's fp32): a one-row
  step reads half the bytes, through torch's fp16 GEMV (fp32 accumulation); several rows run fp32 GEMMs of the
  same fp16 values. A step whose fp16 products overflow is recomputed in fp32. Norms, RoPE, attention, the KV
  cache and the residual stay fp32.
- q|k|v and gate|up fused into one weight each, fp32 weights stored in the layout MKL's batch-1 GEMV reads
  fastest (DenseOp); AWQ weights dequantized into the weight dtype, as AwqLinear computes them.
- int8 weights kept as codes for torch._int_mm: the activation codes, the exact int32 accumulation and the fp32
  dequant epilogue are model_zoo.quant.int8's own, so each output equals Int8Linear's bit for bit, and a
  step reads one byte per weight.
Per step: RoPE's cos/sin once (not per layer), the KV cache written in place, attention over a view of the
cache with no mask where none is needed (every row at the same position), the residual updated in place, one
row's norms and int8 scales as Python floats (fewer small ops), under torch.inference_mode, on threads chosen
for the machine's load (default_threads), the sampler's argmax included (decode_sampled).
CpuModel is tested against ReferenceModel (tests/test_cpu_fast.py): fp32 weights to fp32 rounding, fp16 within
3e-3, the same greedy tokens; tests/bench_cpu_decode.py measures it against transformers.
"""

from __future__ import annotations

import math
import os
import struct
from enum import Enum
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.linear import DenseLinear, Linear
from model_zoo.quant.awq_pack import dequantize_awq
from model_zoo.quant.fp8 import fp8_linear_ref
from model_zoo.quant.int8 import AMAX_MIN, QMAX, ActQuant, act_codes, dequant_epilogue
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear
from model_zoo.reference import KVCache, rms_norm, rope_cos_sin
from model_zoo.weights import LayerWeights, ModelWeights

# One linear of the fast path: x [M, K] -> y [M, N] (N = the fused outputs of its group).
Op = Callable[[torch.Tensor], torch.Tensor]


class CpuDtype(str, Enum):
    """The dtype the CPU backend keeps its float weights in (the lm_head, dense and AWQ linears). The embedding,
    norms, RoPE, attention, the KV cache and the residual stay in the model's dtype (fp32); int8 codes stay int8."""

    FP16 = "fp16"  # half the bytes a decode step reads; products accumulated in fp32; logits ~1e-3 from fp32's
    FP32 = "fp32"  # the reference's numerics (model_zoo/reference.py) to fp32 rounding

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self is CpuDtype.FP16 else torch.float32


class DenseOp:
    """Float weights [N_i, K] of one group, fused: y = x @ W^T.

    fp32: stored as W^T [K, N] when N >= K (MKL's batch-1 sweep over K rows of N is then ~2x its N dot products
    of length K), as W [N, K] otherwise (there the dot products win: 1536 -> 576 down 6.7 vs 8.7 ms, 30 layers).
    fp16 (`halves`): W [N, K]. One row runs torch's fp16 GEMV (fp32 accumulation, the output rounded to fp16;
    30 SmolLM2 layers and its head 15 ms against 30 in fp32); several rows, or `upcast`, fp32 GEMMs of the same
    values widened a block of rows at a time (torch's fp16 GEMM is ~4x slower than fp32 at 64 rows)."""

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
    """Int8Linears of one group sharing their activation quantization: codes [N, K] int8, w_scale fp32 [N].

    One fp32 row (a decode step) takes its scales as Python floats holding fp32 values: the same codes and
    outputs as act_codes / dequant_epilogue, bit for bit, in 7 small ops instead of 14."""

    def __init__(self, linears: Sequence[Int8Linear]):
        self.codes = torch.cat([lin.qweight for lin in linears])  # [N, K]
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
        acc = torch._int_mm(q.to(torch.int8), self.codes.T)  # [M, N] int32, exact
        return dequant_epilogue(acc, a_scale, self.w_scale, x.dtype)  # [M, N]

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        if self.static is None:
            amax = max(float(torch.linalg.vector_norm(x, float("inf"))), _F32_AMAX_MIN)
            inv, a_scale = _f32(QMAX / amax), _f32(amax / QMAX)  # fp32 quotients: a double one rounded once
            q = torch.mul(x, inv).round_()  # [1, K]; |x| <= amax, so |q| <= 127: act_codes' clamp is a no-op
        else:
            inv, a_scale = self.static
            q = torch.mul(x, inv).round_().clamp_(-QMAX, QMAX)  # [1, K]
        return self._product(q, a_scale)

    def normed_row(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(_row_norm(x, weight, eps)) for one fp32 row, the norm's 1 / rms folded into the activation
        scale: 3 small ops fewer; the codes equal the normalized row's up to fp32 rounding (fp16 mode only)."""
        r = _rms_inv(x, eps)
        h = torch.mul(x, weight)  # [1, K]: the normalized row / r
        if self.static is None:
            amax = max(float(torch.linalg.vector_norm(h, float("inf"))) * r, AMAX_MIN)  # the normalized row's
            q = torch.mul(h, _f32(QMAX / amax * r)).round_()  # [1, K], |q| <= 127
            return self._product(q, _f32(amax / QMAX))
        inv, a_scale = self.static
        return self._product(torch.mul(h, _f32(inv * r)).round_().clamp_(-QMAX, QMAX), a_scale)

    def _product(self, q: torch.Tensor, a_scale: float) -> torch.Tensor:
        """Codes q [1, K] (integers in fp32) -> (float(q @ codes^T) * a_scale) * w_scale, [1, N] fp32."""
        acc = torch._int_mm(q.to(torch.int8), self.codes.T)  # [1, N] int32, exact
        return torch.mul(acc, a_scale).mul_(self.w_scale)  # [1, N]


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
        return torch.cat([_apply(op, x, upcast).to(x.dtype) for op in self.ops], dim=-1)  # [M, sum N_i]


def _apply(op: Op, x: torch.Tensor, upcast: bool) -> torch.Tensor:
    """op(x); with `upcast`, ops holding fp16 weights compute in x's dtype (the overflow fallback, CpuModel)."""
    return op(x, upcast=True) if upcast and getattr(op, "halves", False) else op(x)


def _normed(op: Op, x: torch.Tensor, weight: torch.Tensor, eps: float, norm: Callable, upcast: bool) -> torch.Tensor:
    """op(norm(x, weight, eps)); an Int8Op takes a one-row norm into its activation scale."""
    if norm is _row_norm and isinstance(op, Int8Op):
        return op.normed_row(x, weight, eps)
    return _apply(op, norm(x, weight, eps), upcast)


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


def make_op(linears: Sequence[Linear], dtype: torch.dtype) -> Op:
    """One op for linears that read the same input: fused where their numerics allow, else side by side."""
    floats = [_float_weight(lin, dtype) for lin in linears]
    if all(w is not None for w in floats):
        return DenseOp(floats, dtype)
    keys = {_int8_key(lin) for lin in linears}
    if None not in keys and len(keys) == 1:
        return Int8Op(linears)
    fp8 = {(lin.act, lin.a_scale) if isinstance(lin, Fp8Linear) else None for lin in linears}
    if None not in fp8 and len(fp8) == 1:
        return Fp8Op(linears)
    if len(linears) > 1:
        return SplitOp([make_op([lin], dtype) for lin in linears])
    return ForeignOp(linears[0])


class _Layer:
    def __init__(self, layer: LayerWeights, dtype: torch.dtype, store: torch.dtype):
        self.attn_norm = layer.attn_norm.to(dtype)  # [H]
        self.ffn_norm = layer.ffn_norm.to(dtype)  # [H]
        self.qkv = make_op([layer.wq, layer.wk, layer.wv], store)  # H -> q_size + 2 kv_size
        self.o = make_op([layer.wo], store)  # q_size -> H
        self.gate_up = make_op([layer.w_gate, layer.w_up], store)  # H -> 2 F
        self.down = make_op([layer.w_down], store)  # F -> H


class CpuModel:
    """The CPU backend: forward(tokens, cache, rows) -> fp32 logits, the reference's math laid out for speed.

    The weights are laid out in the constructor (load time) and `weights` is not kept: the linears' own tensors
    are freed with it. `threads`: torch threads while it runs (set and restored around each call); None
    chooses them now (default_threads). `weight_dtype`: what the float weights are kept in (CpuDtype); fp16
    only narrows fp32 weights. A one-row step whose fp16 products overflow (|y| > 65504: non-finite logits) is
    run again with every product in fp32, so fp16 never returns an inf the fp32 model would not."""

    name = "torch"

    def __init__(self, weights: ModelWeights, threads: int | None = None,
                 weight_dtype: CpuDtype = CpuDtype.FP16):
        if weights.device.type != "cpu":
            raise ConfigError(f"CpuModel runs on the CPU; the weights are on {weights.device}")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.config: LlamaConfig = weights.config
        self.meta, self.dtype, self.device = weights.meta, weights.dtype, weights.device
        self.threads = default_threads() if threads is None else threads
        self.weight_dtype = CpuDtype(weight_dtype)
        store = weights.dtype if weights.dtype != torch.float32 else self.weight_dtype.torch_dtype
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # the layout's copies are load work: the same threads
        try:
            self.layers = [_Layer(layer, weights.dtype, store) for layer in weights.layers]
            self.head = DenseOp([weights.lm_head], store)  # H -> V
        finally:
            torch.set_num_threads(before)
        self._halves = self.head.halves or any(getattr(op, "halves", False) for layer in self.layers
                                               for op in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.embed = weights.embed  # [V, H]
        self.norm = weights.norm  # [H]
        half = self.config.head_dim // 2
        # rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi]: one op for rotate_half's three, same values
        self._sin_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.dtype)  # [d]

    @property
    def scheme(self) -> str:
        return self.meta.get("scheme", "fp16")

    @property
    def compute(self) -> str:
        """What `fllama generate` reports: the weights' dtype and the products'."""
        if self._halves:
            return "float weights in fp16, fp32 accumulation"
        return f"{str(self.dtype).removeprefix('torch.').replace('float', 'fp')} compute"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.config, batch, max_len, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V] (fp32). With a cache, each row continues at its own length."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._forward(tokens, cache, rows)
        finally:
            torch.set_num_threads(before)

    def decode_sampled(self, tokens: torch.Tensor, cache: KVCache, rows: list[int], sampler) -> torch.Tensor:
        """One decode step (tokens [b] -> the next [b]) with its sampling on the model's threads too: a sampler's
        argmax over the vocabulary is a parallel region like a GEMV (model_zoo/decode_pipe.py calls this)."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            logits = self._forward(tokens[:, None], cache, torch.tensor(rows))[:, -1]  # [b, V]
            return sampler.sample(logits, list(rows))
        finally:
            torch.set_num_threads(before)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, cache: KVCache | None, rows: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        tokens = tokens.to(self.device)
        B, S = tokens.shape
        check_token_ids(tokens, c.vocab_size)
        if cache is None:
            row_ids, starts = None, [0] * B
        else:
            row_ids = list(range(B)) if rows is None else [int(r) for r in rows]
            starts = [int(cache.lengths[r]) for r in row_ids]
            if max(starts) + S > cache.max_len:
                raise ValueError(f"KV cache of {cache.max_len} positions cannot hold {max(starts) + S}")
        positions = torch.tensor(starts)[:, None] + torch.arange(S)  # [B, S]
        cos, sin = rope_cos_sin(c, positions.to(self.device), self.dtype)  # [B, S, d]: once, not per layer
        rope = (cos[:, None], (sin * self._sin_sign)[:, None])  # [B, 1, S, d] each
        attend = _Attention(c, cache, row_ids, starts, S, positions)
        logits = self._steps(tokens, B, S, rope, attend, upcast=False)
        if self._halves and B * S == 1 and not math.isfinite(float(logits.sum())):  # an fp16 product overflowed
            logits = self._steps(tokens, B, S, rope, attend, upcast=True)  # rewrites this step's cache entries
        if cache is not None:
            for r in row_ids:
                cache.lengths[r] += S
        return logits

    def _steps(self, tokens: torch.Tensor, B: int, S: int, rope: tuple[torch.Tensor, torch.Tensor],
               attend: "_Attention", upcast: bool) -> torch.Tensor:
        """The layers and the head: tokens [B, S] -> logits [B, S, V] (fp32)."""
        x = F.embedding(tokens.reshape(B * S), self.embed)  # [B*S, H], a new tensor: the residual adds in place
        norm = _row_norm if self._halves and B * S == 1 and not upcast else _norm
        for i, layer in enumerate(self.layers):
            self._layer(layer, x, B, S, rope, attend, i, upcast, norm)
        x = norm(x, self.norm, self.config.norm_eps)
        return _apply(self.head, x, upcast).float().view(B, S, -1)  # [B, S, V]

    def _layer(self, layer: _Layer, x: torch.Tensor, B: int, S: int, rope: tuple[torch.Tensor, torch.Tensor],
               attend: "_Attention", index: int, upcast: bool, norm: Callable) -> None:
        """One decoder layer on the residual x [B*S, H], in place. A one-row step of fp16 weights gets fp16
        outputs (DenseOp): RoPE, the cache and the residual's in-place adds widen them; SiLU(gate) * up stays
        fp16, the down projection's input."""
        c = self.config
        nh, nkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        qkv = _normed(layer.qkv, x, layer.attn_norm, c.norm_eps, norm, upcast)  # [B*S, q + 2kv]
        qkv = qkv.view(B, S, nh + 2 * nkv, d).transpose(1, 2)  # [B, nh + 2 n_kv, S, d]
        qk = qkv[:, :nh + nkv]  # q and k rotated together
        qk = qk * rope[0] + torch.roll(qk, d // 2, -1) * rope[1]  # apply_rope's values, in the rope's dtype
        o = attend(index, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:])  # [B, nh, S, d]
        x += _apply(layer.o, o.transpose(1, 2).reshape(B * S, c.q_size), upcast)
        gu = _normed(layer.gate_up, x, layer.ffn_norm, c.norm_eps, norm, upcast)  # [B*S, 2F]
        gate = F.silu(gu[:, :c.ffn_size], inplace=True)  # [B*S, F], a view of gu
        x += _apply(layer.down, gate.mul_(gu[:, c.ffn_size:]), upcast)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm; in fp32 torch's own rms_norm gives the same values bit for bit, with less overhead."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)


def _row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """_norm of one row [1, H] in 3 small ops instead of rms_norm's 7 (a decode step of fp16 weights, whose
    products round far more): x * w / sqrt(mean(x^2) + eps), the mean from the row's 2-norm."""
    return torch.mul(x, weight).mul_(_rms_inv(x, eps))  # [1, H]


def _rms_inv(x: torch.Tensor, eps: float) -> float:
    """1 / sqrt(mean(x^2) + eps) of one row [1, H], from its 2-norm: one small op."""
    return (float(torch.linalg.vector_norm(x)) ** 2 / x.shape[-1] + eps) ** -0.5


def default_threads() -> int:
    """Torch threads for the CPU backend: the cores this process may use (at most torch's own count), less the
    machine's 1-minute load average, at least 1. Each GEMV is a parallel region that ends only when all its
    threads have run: with more threads than idle cores, every region waits for a descheduled one (2 busy
    cores: 4 tok/s with 2 threads, 25 with 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    cores = min(cores, torch.get_num_threads())
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return max(1, min(cores, round(cores - load)))


class _Attention:
    """Attention of one forward call: writes each layer's new K/V into the cache and attends over it."""

    def __init__(self, config: LlamaConfig, cache: KVCache | None, rows: list[int] | None, starts: list[int],
                 S: int, positions: torch.Tensor):
        self.cache, self.rows, self.starts, self.S = cache, rows, starts, S
        self.gqa = config.gqa_ratio > 1
        B = len(starts)
        self.T = max(starts) + S  # keys attended: positions 0..T-1
        self.span = None  # (first row, rows) of the cache rows when they are consecutive (a view, no gather)
        if rows is not None and rows == list(range(rows[0], rows[0] + B)):
            self.span = rows[0], B
        same = len(set(starts)) == 1
        self.block = self.span is not None and same  # the new K/V are one block of the cache: one copy each
        self.causal = cache is None or (same and starts[0] == 0)  # keys 0..S-1 for queries 0..S-1
        self.mask = None
        if not self.causal and not (same and S == 1):  # ragged rows or a continued prompt
            key_pos = torch.arange(self.T, device=positions.device)
            self.mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, T]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh, S, d], k/v [B, n_kv, S, d] of the new tokens -> [B, nh, S, d]."""
        if self.cache is not None:
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            if self.block:  # narrow + copy_: half the dispatches of an indexed assignment, at ~30 a step
                s = self.starts[0]
                k_cache.narrow(0, *self.span).narrow(2, s, self.S).copy_(k)
                v_cache.narrow(0, *self.span).narrow(2, s, self.S).copy_(v)
            else:
                for b, (r, s) in enumerate(zip(self.rows, self.starts)):
                    k_cache[r, :, s:s + self.S] = k[b]
                    v_cache[r, :, s:s + self.S] = v[b]
            if self.span is not None:
                k = k_cache.narrow(0, *self.span).narrow(2, 0, self.T)  # [B, n_kv, T, d] views
                v = v_cache.narrow(0, *self.span).narrow(2, 0, self.T)
            else:
                idx = torch.tensor(self.rows, device=k_cache.device)
                k, v = k_cache[idx, :, :self.T], v_cache[idx, :, :self.T]  # [B, n_kv, T, d]
        if v.dtype != q.dtype or k.dtype != q.dtype:  # v of an fp16 product when there is no cache
            k, v = k.to(q.dtype), v.to(q.dtype)
        is_causal = self.causal and self.S > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=is_causal,
                                              enable_gqa=self.gqa)  # [B, nh, S, d]
