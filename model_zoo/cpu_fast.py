"""The CPU backend: the reference model's math (model_zoo/reference.py), laid out for decoding on a CPU.

At a 135M model's size a decode step is ~0.27 GFLOP: what costs is reading the weights and the per-op overhead,
so whatever can be done once is done at load (and counted as load, not as the first prefill), by the ops of
model_zoo/cpu_ops.py:
- float weights kept in fp16 by default (CpuDtype; `--cpu-dtype fp32` keeps the reference's fp32): a decode
  step reads half the bytes. On x86 builds of torch they are packed for FBGEMM's fp16 GEMM: activations, sums
  and outputs stay fp32, only the weights are rounded (~5e-4 of SmolLM2's logits). Elsewhere one row runs torch's
  fp16 GEMV (fp16 activations and outputs too; a step whose fp16 products overflow is recomputed in fp32) and
  several rows fp32 GEMMs of the same values. Norms, RoPE, attention, the KV cache and the residual stay fp32.
- q|k|v and gate|up fused into one weight each; AWQ weights dequantized into the weight dtype at load.
- int8 weights kept as codes (model_zoo/cpu_int8.py: FBGEMM's int8 GEMM where it sums exactly, else
  torch._int_mm): the activation codes, the exact int32 sums and the fp32 dequant epilogue are
  model_zoo.quant.int8's own, so each output equals Int8Linear's bit for bit, and a step reads a byte a weight.
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
from enum import Enum
from typing import Callable

import torch
import torch.nn.functional as F

from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.cpu_ops import Int8Op, Op, apply_op, dense_op, make_op, rms_inv
from model_zoo.errors import ConfigError
from model_zoo.reference import KVCache, rms_norm, rope_cos_sin
from model_zoo.weights import LayerWeights, ModelWeights


class CpuDtype(str, Enum):
    """The dtype the CPU backend keeps its float weights in (the lm_head, dense and AWQ linears). The embedding,
    norms, RoPE, attention, the KV cache and the residual stay in the model's dtype (fp32); int8 codes stay int8."""

    FP16 = "fp16"  # half the bytes a step reads; fp32 activations and sums (FBGEMM); logits ~5e-4 from fp32's
    FP32 = "fp32"  # the reference's numerics (model_zoo/reference.py) to fp32 rounding

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self is CpuDtype.FP16 else torch.float32


def _normed(op: Op, x: torch.Tensor, weight: torch.Tensor, eps: float, norm: Callable, upcast: bool) -> torch.Tensor:
    """op(norm(x, weight, eps)); an Int8Op takes a one-row norm into its activation scale."""
    if norm is _row_norm and isinstance(op, Int8Op):
        return op.normed_row(x, weight, eps)
    return apply_op(op, norm(x, weight, eps), upcast)


class _Layer:
    def __init__(self, layer: LayerWeights, dtype: torch.dtype, store: torch.dtype):
        self.attn_norm = layer.attn_norm.to(dtype)  # [H]
        self.ffn_norm = layer.ffn_norm.to(dtype)  # [H]
        self.qkv = make_op([layer.wq, layer.wk, layer.wv], store, dtype)  # H -> q_size + 2 kv_size
        self.o = make_op([layer.wo], store, dtype)  # q_size -> H
        self.gate_up = make_op([layer.w_gate, layer.w_up], store, dtype)  # H -> 2 F
        self.down = make_op([layer.w_down], store, dtype)  # F -> H

    def ops(self) -> tuple[Op, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class CpuModel:
    """The CPU backend: forward(tokens, cache, rows) -> fp32 logits, the reference's math laid out for speed.

    The weights are laid out in the constructor (load time) and `weights` is not kept: the linears' own tensors
    are freed with it. `threads`: torch threads while it runs (set and restored around each call); None
    chooses them now (default_threads). `weight_dtype`: what the float weights are kept in (CpuDtype); fp16
    only narrows fp32 weights, and only those within fp16's range. On torch's fp16 GEMV (no FBGEMM), a one-row
    step whose fp16 products overflow (|y| > 65504: non-finite logits) is run again with every product in fp32,
    so fp16 never returns an inf the fp32 model would not."""

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
            self.head = dense_op([weights.lm_head], store, weights.dtype)  # H -> V
        finally:
            torch.set_num_threads(before)
        ops = [self.head, *(op for layer in self.layers for op in layer.ops())]
        self._halves = any(getattr(op, "halves", False) for op in ops)  # fp16 outputs: overflow is possible
        self._narrow = store == torch.float16  # one-row steps take the Python-float norms (_row_norm)
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
        if self._narrow:
            return "float weights in fp16, fp32 accumulation"
        return f"{str(self.dtype).removeprefix('torch.').replace('float', 'fp')} compute"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.config, batch, max_len, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                rows: torch.Tensor | None = None, *, last: bool = False) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V] (fp32). With a cache, each row continues at its own length.
        last: each row's last position only, [B, 1, V]."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._forward(tokens, cache, rows, last)
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
    def _forward(self, tokens: torch.Tensor, cache: KVCache | None, rows: torch.Tensor | None,
                 last: bool = False) -> torch.Tensor:
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
        logits = self._steps(tokens, B, S, rope, attend, upcast=False, last=last)
        if self._halves and B * S == 1 and not math.isfinite(float(logits.sum())):  # an fp16 product overflowed
            logits = self._steps(tokens, B, S, rope, attend, upcast=True, last=last)  # rewrites this step's cache
        if cache is not None:
            for r in row_ids:
                cache.lengths[r] += S
        return logits

    def _steps(self, tokens: torch.Tensor, B: int, S: int, rope: tuple[torch.Tensor, torch.Tensor],
               attend: "_Attention", upcast: bool, last: bool = False) -> torch.Tensor:
        """The layers and the head: tokens [B, S] -> logits [B, S, V] (fp32); last: [B, 1, V], the last positions."""
        x = F.embedding(tokens.reshape(B * S), self.embed)  # [B*S, H], a new tensor: the residual adds in place
        norm = _row_norm if self._narrow and B * S == 1 and not upcast else _norm
        for i, layer in enumerate(self.layers):
            self._layer(layer, x, B, S, rope, attend, i, upcast, norm)
        if last and S > 1:
            x, S = x.view(B, S, -1)[:, -1].contiguous(), 1  # [B, H]
        x = norm(x, self.norm, self.config.norm_eps)
        return apply_op(self.head, x, upcast).float().view(B, S, -1)  # [B, S, V]

    def _layer(self, layer: _Layer, x: torch.Tensor, B: int, S: int, rope: tuple[torch.Tensor, torch.Tensor],
               attend: "_Attention", index: int, upcast: bool, norm: Callable) -> None:
        """One decoder layer on the residual x [B*S, H], in place. A one-row step on torch's fp16 GEMV gets fp16
        outputs (DenseOp): RoPE, the cache and the residual's in-place adds widen them; SiLU(gate) * up stays
        fp16, the down projection's input. FBGEMM's outputs are fp32."""
        c = self.config
        nh, nkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        qkv = _normed(layer.qkv, x, layer.attn_norm, c.norm_eps, norm, upcast)  # [B*S, q + 2kv]
        qkv = qkv.view(B, S, nh + 2 * nkv, d).transpose(1, 2)  # [B, nh + 2 n_kv, S, d]
        qk = qkv[:, :nh + nkv]  # q and k rotated together
        qk = qk * rope[0] + torch.roll(qk, d // 2, -1) * rope[1]  # apply_rope's values, in the rope's dtype
        o = attend(index, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:])  # [B, nh, S, d]
        x += apply_op(layer.o, o.transpose(1, 2).reshape(B * S, c.q_size), upcast)
        gu = _normed(layer.gate_up, x, layer.ffn_norm, c.norm_eps, norm, upcast)  # [B*S, 2F]
        gate = F.silu(gu[:, :c.ffn_size], inplace=True)  # [B*S, F], a view of gu
        x += apply_op(layer.down, gate.mul_(gu[:, c.ffn_size:]), upcast)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm; in fp32 torch's own rms_norm gives the same values bit for bit, with less overhead."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)


def _row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """_norm of one row [1, H] in 3 small ops instead of rms_norm's 7 (a decode step of fp16 weights, whose
    products round far more): x * w / sqrt(mean(x^2) + eps), the mean from the row's 2-norm."""
    return torch.mul(x, weight).mul_(rms_inv(x, eps))  # [1, H]


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
