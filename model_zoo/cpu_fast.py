"""The CPU backend: the reference model's math (model_zoo/reference.py), laid out for decoding on a CPU.

At a 135M model's size a decode step is ~0.27 GFLOP: what costs is reading the weights and the per-op overhead,
so whatever can be done once is done at load (and counted as load, not as the first prefill):
- q|k|v and gate|up fused into one weight each, each weight stored in the layout MKL's batch-1 GEMV reads
  fastest (DenseOp); AWQ weights dequantized exactly into the compute dtype, as AwqLinear computes them.
- int8 weights kept as codes for torch._int_mm: the activation codes, the exact int32 accumulation and the fp32
  dequant epilogue are model_zoo.quant.int8's own, so each output equals Int8Linear's bit for bit, and a
  step reads one byte per weight instead of four.
Per step: RoPE's cos/sin once (not per layer), the KV cache written in place by slices, attention over a view
of the cache with no mask where none is needed (every row at the same position), the residual updated in
place, under torch.inference_mode, on threads chosen for the machine's load (default_threads).
CpuModel is tested against ReferenceModel (tests/test_cpu_fast.py): same greedy tokens, logits equal to fp32
rounding; tests/bench_cpu_decode.py measures it against transformers.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.linear import DenseLinear, Linear
from model_zoo.quant.awq_pack import dequantize_awq
from model_zoo.quant.int8 import ActQuant, act_codes, dequant_epilogue
from model_zoo.quant.linear import AwqLinear, Int8Linear
from model_zoo.reference import KVCache, rms_norm, rope_cos_sin
from model_zoo.weights import LayerWeights, ModelWeights

# One linear of the fast path: x [M, K] -> y [M, N] (N = the fused outputs of its group).
Op = Callable[[torch.Tensor], torch.Tensor]


class DenseOp:
    """Float weights [N_i, K] of one group, fused: y = x @ W^T. Stored as W^T [K, N] when N >= K (MKL's batch-1
    sweep over K rows of N is then ~2x its N dot products of length K), as W [N, K] otherwise (there the dot
    products win: 1536 -> 576 down projection 6.7 vs 8.7 ms for 30 layers)."""

    def __init__(self, weights: Sequence[torch.Tensor], dtype: torch.dtype):
        w = torch.cat([w.to(dtype) for w in weights])  # [N, K]
        self.transposed = w.shape[0] >= w.shape[1]
        self.w = w.T.contiguous() if self.transposed else w.contiguous()  # [K, N] or [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.w.dtype)
        return x @ self.w if self.transposed else F.linear(x, self.w)  # [M, N]


class Int8Op:
    """Int8Linears of one group sharing their activation quantization: codes [N, K] int8, w_scale fp32 [N]."""

    def __init__(self, linears: Sequence[Int8Linear]):
        self.codes = torch.cat([lin.qweight for lin in linears])  # [N, K]
        self.w_scale = torch.cat([lin.w_scale for lin in linears])  # [N]
        self.act, self.a_amax = linears[0].act, linears[0].a_amax

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, a_scale = act_codes(x, self.act, self.a_amax)  # [M, K] exact integers in fp32, [M]
        acc = torch._int_mm(q.to(torch.int8), self.codes.T)  # [M, N] int32, exact
        return dequant_epilogue(acc, a_scale, self.w_scale, x.dtype)  # [M, N]


class SplitOp:
    """Linears that cannot share one weight (mixed kinds or activation ranges): each alone, outputs joined."""

    def __init__(self, ops: Sequence[Op]):
        self.ops = list(ops)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([op(x) for op in self.ops], dim=-1)  # [M, sum N_i]


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
    if len(linears) > 1:
        return SplitOp([make_op([lin], dtype) for lin in linears])
    return ForeignOp(linears[0])


class _Layer:
    def __init__(self, layer: LayerWeights, dtype: torch.dtype):
        self.attn_norm = layer.attn_norm.to(dtype)  # [H]
        self.ffn_norm = layer.ffn_norm.to(dtype)  # [H]
        self.qkv = make_op([layer.wq, layer.wk, layer.wv], dtype)  # H -> q_size + 2 kv_size
        self.o = make_op([layer.wo], dtype)  # q_size -> H
        self.gate_up = make_op([layer.w_gate, layer.w_up], dtype)  # H -> 2 F
        self.down = make_op([layer.w_down], dtype)  # F -> H


class CpuModel:
    """The CPU backend: forward(tokens, cache, rows) -> fp32 logits, the reference's math laid out for speed.

    The weights are laid out in the constructor (load time) and `weights` is not kept: the linears' own tensors
    are freed with it. `threads`: torch threads while it runs (set and restored around each call); None
    chooses them now (default_threads)."""

    name = "torch"

    def __init__(self, weights: ModelWeights, threads: int | None = None):
        if weights.device.type != "cpu":
            raise ConfigError(f"CpuModel runs on the CPU; the weights are on {weights.device}")
        if threads is not None and threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.config: LlamaConfig = weights.config
        self.meta, self.dtype, self.device = weights.meta, weights.dtype, weights.device
        self.threads = default_threads() if threads is None else threads
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # the layout's copies are load work: the same threads
        try:
            dtype = weights.dtype
            self.layers = [_Layer(layer, dtype) for layer in weights.layers]
            self.head = DenseOp([weights.lm_head], dtype)  # H -> V
        finally:
            torch.set_num_threads(before)
        self.embed = weights.embed  # [V, H]
        self.norm = weights.norm  # [H]
        half = self.config.head_dim // 2
        # rotate_half(x) * sin == roll(x, d/2) * [-sin_lo, sin_hi]: one op for rotate_half's three, same values
        self._sin_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.dtype)  # [d]

    @property
    def scheme(self) -> str:
        return self.meta.get("scheme", "fp16")

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
        x = F.embedding(tokens.reshape(B * S), self.embed)  # [B*S, H], a new tensor: the residual adds in place
        for i, layer in enumerate(self.layers):
            self._layer(layer, x, B, S, rope, attend, i)
        if cache is not None:
            for r in row_ids:
                cache.lengths[r] += S
        x = _norm(x, self.norm, c.norm_eps)
        return self.head(x).float().view(B, S, -1)  # [B, S, V]

    def _layer(self, layer: _Layer, x: torch.Tensor, B: int, S: int, rope: tuple[torch.Tensor, torch.Tensor],
               attend: "_Attention", index: int) -> None:
        """One decoder layer on the residual x [B*S, H], in place."""
        c = self.config
        nh, nkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        qkv = layer.qkv(_norm(x, layer.attn_norm, c.norm_eps))  # [B*S, q + 2kv]
        qkv = qkv.view(B, S, nh + 2 * nkv, d).transpose(1, 2)  # [B, nh + 2 n_kv, S, d]
        qk = qkv[:, :nh + nkv]  # q and k rotated together
        qk = qk * rope[0] + torch.roll(qk, d // 2, -1) * rope[1]  # apply_rope's values
        o = attend(index, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:])  # [B, nh, S, d]
        x += layer.o(o.transpose(1, 2).reshape(B * S, c.q_size)).to(x.dtype)
        gu = layer.gate_up(_norm(x, layer.ffn_norm, c.norm_eps))  # [B*S, 2F]
        gate = F.silu(gu[:, :c.ffn_size], inplace=True)  # [B*S, F], a view of gu
        x += layer.down(gate.mul_(gu[:, c.ffn_size:])).to(x.dtype)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm; in fp32 torch's own rms_norm gives the same values bit for bit, with less overhead."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)


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
        self.span = None  # the cache rows as one slice, when they are consecutive (a view, no gather)
        if rows is not None and rows == list(range(rows[0], rows[0] + B)):
            self.span = slice(rows[0], rows[0] + B)
        same = len(set(starts)) == 1
        self.causal = cache is None or (same and starts[0] == 0)  # keys 0..S-1 for queries 0..S-1
        self.mask = None
        if not self.causal and not (same and S == 1):  # ragged rows or a continued prompt
            key_pos = torch.arange(self.T, device=positions.device)
            self.mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, T]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh, S, d], k/v [B, n_kv, S, d] of the new tokens -> [B, nh, S, d]."""
        if self.cache is not None:
            k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
            for b, (r, s) in enumerate(zip(self.rows, self.starts)):
                k_cache[r, :, s:s + self.S] = k[b]
                v_cache[r, :, s:s + self.S] = v[b]
            if self.span is not None:
                k, v = k_cache[self.span, :, :self.T], v_cache[self.span, :, :self.T]  # [B, n_kv, T, d] views
            else:
                idx = torch.tensor(self.rows, device=k_cache.device)
                k, v = k_cache[idx, :, :self.T], v_cache[idx, :, :self.T]  # [B, n_kv, T, d]
            k, v = k.to(q.dtype), v.to(q.dtype)
        is_causal = self.causal and self.S > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=is_causal,
                                              enable_gqa=self.gqa)  # [B, nh, S, d]
