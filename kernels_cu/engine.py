"""The GPU engine: a decoder of PyCUDA kernels for fp16, INT8 W8A8 and AWQ int4 checkpoints.

Per layer (ARCHITECTURE.md, "Engine"): RMSNorm (+ int8 quantization) -> fused QKV GEMM -> RoPE + KV-cache
write -> attention (prefill: SDPA per row; decode: split over the sequence) -> o_proj GEMM with the residual
added in its epilogue -> RMSNorm (+ quant) -> fused gate|up GEMM -> SiLU(gate) * up (+ quant) -> down GEMM
with the residual. Around the layers: embedding lookup, final norm, lm_head in fp16 (or int8 codes with a scale
per vocabulary row, EngineConfig.lm_head_int8: half the bytes of the largest single read of a decode step).

Decode steps of a batch-size bucket are captured once as a CUDA graph and replayed: token ids, positions
and lengths live in device buffers, so one graph serves every step. Prefill runs eagerly. The engine is a
Backend of the same generation loop as the CPU reference (model_zoo.generation).
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from calibrate.int8 import quantize_weight_int8
from kernels_cu import build, norm_fold
from kernels_cu.attention_decode import (attention_decode, attention_decode_quant, attention_decode_rope,
                                         attention_decode_rope_parts, attention_decode_rope_quant)
from kernels_cu.attention_prefill import attention_prefill
from kernels_cu.awq_gemm import awq_gemm
from kernels_cu.awq_gemv import GEMV_MAX_M as AWQ_GEMV_MAX_M, awq_linear, gemv_takes, pack_for_gemv
from kernels_cu.awq_gemv import folds as awq_folds
from kernels_cu.embedding import embedding, embedding_fold
from kernels_cu.fp16_gemv import DECODE_MAX_M, fp16_linear, fp16_swiglu, w8a16_linear
from kernels_cu.int8_gemm import (XQ_MAX_ROWS, DeferredQuant, NormQuant, int8_gemm, int8_gemm_deferred,
                                  int8_gemm_norm, int8_swiglu, int8_swiglu_norm, norm_in_loop)
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.quantize import quantize, quantize_fold
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_quant
from kernels_cu.rope_kv import rope_kv, rope_table
from kernels_cu.sampling import GpuSampler, StepState
from kernels_cu.silu_mul import silu_mul, silu_mul_quant
from kernels_cu.swiglu_layout import interleave_gate_up
from model_zoo.config import LlamaConfig
from model_zoo.errors import DeviceError, PromptError
from model_zoo.linear import DenseLinear
from model_zoo.quantized_linear import ActQuant, AwqLinear, Int8Linear
from model_zoo.sampling import SamplingConfig, fresh_seed
from model_zoo.weights import ModelWeights

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode graphs are captured per bucket; a batch runs in the next one up
# Up to SWIGLU_INT8_ROWS rows an int8 gate|up GEMV applies the SwiGLU in its epilogue and quantize_fold quantizes
# it for down_proj from its maxima (where down_proj does not quantize its input itself): the bits of the GEMV, then
# silu_mul_quant, one kernel fewer. In-process A/B (H200): +0.7 / +0.5 / +0.6% at 2 / 4 / 8 rows, -0.8% at 16 (the
# two-tile GEMV's longer epilogue). Switch for A/B runs.
SWIGLU_INT8_GEMV = True
SWIGLU_INT8_ROWS = 8
# Decode buckets whose RMSNorms are deferred into the GEMVs (norm_fold.py), where that measured faster (engine
# A/B, H200: fp16 +1.7 / +1.4 / +0.5% at 1 / 4 / 8 rows, awq +2.6 / +3.1% at 1 / 4; H100: awq -0.3 / -3.0% at
# 8 / 16 rows, fp16 -0.3% at 16: each consumer GEMV's blocks pay for the reduction, more of it with more rows)
FOLD_MAX_ROWS = {"fp16": 8, "awq": 4}
# The two int8 quantizations a deferring decode step (EngineConfig.defer_int8_quant) moves into the GEMVs: o_proj's
# input (attention writes fp16 and each unit's max) and down_proj's (the SwiGLU in the gate|up GEMV's epilogue).
# Module switches for A/B runs (engine_ab --switch engine.DEFER_SWIGLU).
DEFER_ATTENTION = True
DEFER_SWIGLU = True
# Where down_proj quantizes its input and gate|up takes the deferred norm (an int8 step with both deferrals): the SwiGLU
# GEMV also writes each row's max itself (an atomic max into a buffer cleared before it: by the quantize_fold before
# it, or at one row, where no quantize_fold runs (int8_gemm.NORM_ROW_LOOP), by the layer's q|k|v GEMV), so
# down_proj's 256 blocks each read one float instead of 1,376 partial maxima (5.5 KB from the same L2 lines at
# once). Switch for A/B runs.
SWIGLU_ROW_AMAX = True
# An int8 decode step (up to DECODE_MAX_M rows) defers its RMSNorms too (EngineConfig.fold_norms): o_proj and
# down_proj write the next norm's xg, sums and maxima (norm_fold.py), and quantize_fold, spread over blocks,
# quantizes xg for q|k|v / gate|up instead of rmsnorm_quant's one block per row (the embedding writes layer 0's, as
# for fp16 / AWQ; the final norm stays an rmsnorm kernel). Switch for A/B runs.
FOLD_INT8 = True
# Up to QUANT_FOLD_EARLY_ROWS rows the int8 decode step's quantize_fold kernels let the GEMV after them (q|k|v,
# gate|up, down) launch before their own wait (quantize_fold(early=True)), so that the GEMV's weight prefetch runs
# under the producer GEMV's tail, as where two GEMVs follow each other: behind the 1.4 us kernel it started only
# ~0.8 us before its wait returned (timeline, H100). In-process A/B (H200): +2.0 / +1.0 / +0.4 / -0.3% at 1 / 4 /
# 8 / 16 rows. Switch for A/B runs.
QUANT_FOLD_EARLY = True
QUANT_FOLD_EARLY_ROWS = 8
# Eager prefill costs the host ~25-80 us a kernel (torch ops, allocations, checks, the launch), so a short one is
# host-bound: at 512 tokens (batch 1, H200) the GPU is busy ~11 ms of int8's and fp16's ~20-35 ms. A prefill of up
# to PREFILL_GRAPH_TOKENS tokens (rows x length) whose shape (rows, length, starts) comes a second time is captured
# into a CUDA graph, and replayed from then on (eval's fixed windows, repeated prompts, benchmarks; torch.compile's
# reduce-overhead mode does the same per shape). Longer prefills are GPU-bound and stay eager. Each graph keeps its
# own activation memory, so a cache keeps the PREFILL_GRAPHS most recently used.
PREFILL_GRAPH_TOKENS = 1024
PREFILL_GRAPHS = 2
PREFILL_SEEN_MAX = 256  # shapes remembered as seen once; the set restarts when full
LM_HEAD_QUANT_ROWS = 4096  # vocabulary rows quantized at a time (EngineConfig.lm_head_int8)


def _early_fold(rows: int) -> bool:
    """Whether a quantize_fold of `rows` rows, followed by an int8 decode GEMV, lets that GEMV launch early."""
    return QUANT_FOLD_EARLY and rows <= QUANT_FOLD_EARLY_ROWS


@contextmanager
def _caller_ordered():
    """Run on fllama's stream, ordered after the caller's stream and before whatever the caller does next.

    fllama's stream is non-blocking: without these two event waits, the engine could read inputs the caller's
    stream has not finished writing (token ids copied to the GPU), and the caller could read results (logits,
    sampled ids, lengths) before the engine has written them."""
    caller = torch.cuda.current_stream()
    ours = build.torch_stream()
    if caller.cuda_stream == ours.cuda_stream:
        yield
        return
    ours.wait_stream(caller)
    with build.on_stream():
        yield
    caller.wait_stream(ours)


def _record(body: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """body's kernels and torch ops captured on fllama's stream (the one every launch checks): (graph, its output).
    What body launches must already be built and warmed up; the capture itself runs nothing."""
    build.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=build.torch_stream()):
        out = body()
    return graph, out


def _api(fn: Callable) -> Callable:
    """For the engine's public methods: every call is ordered with the caller's stream (see above)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # no_grad, not inference_mode: the caches and buffers must stay ordinary tensors that callers (the
        # chat session's cache.lengths) may update in place outside any mode. Programmatic launch: the
        # weights were written and synchronized in __init__, so kernels may prefetch them early.
        with torch.no_grad(), _caller_ordered(), build.programmatic():
            return fn(*args, **kwargs)
    return wrapper


# ---------------------------------------------------------------------------------------------- linears
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
        if self.swiglu:
            return fp16_swiglu(x, self.weight, fold_in=fold_in)
        # Beyond the GEMV's rows cuBLAS adds the residual in its epilogue only when writing over it (torch
        # copies it to a separate output first): the layer's residual stream is dead after this op.
        out = residual if residual is not None and x.shape[0] > DECODE_MAX_M else None
        return fp16_linear(x, self.weight, residual, out, fold_in, fold_out)

    def folds(self, m: int) -> bool:
        return m <= DECODE_MAX_M

    def nbytes(self) -> int:
        return self.weight.numel() * 2


class AwqOp:
    """y = x @ dequant(W)^T (+ residual). Repacked once into awq_gemv's layout where its kernel takes the
    shape (then a gate|up op with `swiglu` returns silu(gate) * up itself); else AutoAWQ's GEMM layout."""

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
            # Beyond the GEMV's rows the product goes through cuBLAS, which adds the residual in place as for
            # Fp16Op: the layer's residual stream is dead after this op.
            out = residual if residual is not None and x.shape[0] > AWQ_GEMV_MAX_M else None
            return awq_linear(x, self.packed, residual, out, fold_in, fold_out)
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
    swiglu = False  # its down_proj takes the SwiGLU output quantized: silu_mul_quant, or swiglu_deferred at one row

    def __init__(self, qweight: torch.Tensor, w_scale: torch.Tensor, amax: torch.Tensor | None):
        self.qweight, self.w_scale = qweight, w_scale  # [N, K] int8, [N] fp32
        self.amax = amax  # [1] fp32 for static activations, None for per-token dynamic

    def __call__(self, xq: tuple[torch.Tensor, torch.Tensor] | DeferredQuant | NormQuant,
                 residual: torch.Tensor | None = None, fold_in: FoldIn | None = None,
                 fold_out: FoldOut | None = None) -> torch.Tensor:
        """fold_out: the next RMSNorm deferred (a decode GEMV with a residual); a deferred RMSNorm before this op
        arrives as a NormQuant (or quantized by quantize_fold), never as fold_in."""
        if fold_in is not None:
            raise DeviceError("an int8 linear takes its deferred RMSNorm as a NormQuant or quantized")
        if isinstance(xq, NormQuant):
            if residual is not None or fold_out is not None:
                raise DeviceError("an int8 linear after a deferred norm takes no residual")
            return int8_gemm_norm(xq, self.qweight, self.w_scale)
        if isinstance(xq, DeferredQuant):
            return int8_gemm_deferred(xq, self.qweight, self.w_scale, residual, fold_out=fold_out)
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


def _fuse(linears: list, device: torch.device, swiglu: bool = False):
    """One GPU op for linears that read the same input (q|k|v, gate|up), concatenated along N; `swiglu`
    lets an op that can (fp16, AWQ) apply silu(gate) * up itself."""
    first = linears[0]
    if isinstance(first, Int8Linear):
        qweight = torch.cat([l.qweight for l in linears]).to(device)  # [sum N, K]
        w_scale = torch.cat([l.w_scale.float() for l in linears]).to(device)  # [sum N]
        static = first.act == ActQuant.STATIC
        if static and len({float(l.a_amax) for l in linears}) != 1:
            raise DeviceError("fused int8 linears need one static activation scale")  # load_quantized_weights unifies
        amax = torch.tensor([float(first.a_amax)], dtype=torch.float32, device=device) if static else None
        return Int8Op(qweight.contiguous(), w_scale.contiguous(), amax)
    if isinstance(first, AwqLinear):
        qweight = torch.cat([l.qweight for l in linears], dim=1).to(device)  # [K, sum N / 8]
        qzeros = torch.cat([l.qzeros for l in linears], dim=1).to(device)  # [K/G, sum N / 8]
        scales = torch.cat([l.scales for l in linears], dim=1).to(device, torch.float16)  # [K/G, sum N]
        return AwqOp(qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), swiglu=swiglu)
    if isinstance(first, DenseLinear):
        w = torch.cat([l.dense_weight() for l in linears]).to(device, torch.float16)  # [sum N, K]
        return Fp16Op(w.contiguous(), swiglu=swiglu)
    raise DeviceError(f"the GPU engine cannot run linears of type {type(first).__name__}")


@dataclass
class GpuLayer:
    attn_norm: torch.Tensor  # [H] fp16
    ffn_norm: torch.Tensor  # [H] fp16
    qkv: Any  # H -> (n_heads + 2 n_kv) * head_dim
    o: Any
    gate_up: Any  # H -> 2F
    down: Any


# ----------------------------------------------------------------------------------------------- cache
@dataclass
class GpuCache:
    """A KV cache for one batch bucket. `lengths` is the device tensor the decode graph reads; storage has
    one spare position per row so a row that is not decoding this step can write past its end harmlessly."""

    k: list[torch.Tensor]  # per layer [Bb, n_kv, cap + 1, d] fp16 (int8 with kv_int8)
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [Bb] int32
    max_len: int  # positions a row may hold (<= cap)
    batch: int  # rows the caller asked for (<= Bb)
    k_scale: list = field(default_factory=list)  # with kv_int8: per layer [Bb, n_kv, cap + 1] fp32 (x = q * scale)
    v_scale: list = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # "logits" | "sampled" -> (CUDA graph, its output tensor)
    # prefill graphs: (rows, length, starts) -> (graph, its ids input, its logits, the other inputs it reads),
    # least recently used first
    prefill_graphs: OrderedDict = field(default_factory=OrderedDict)
    prefill_seen: set = field(default_factory=set)  # prefill shapes run once, eagerly
    static: dict = field(default_factory=dict)  # buffers the decode graphs use: tokens, active, row, lens, row_amax

    @property
    def bucket(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] - 1

    def scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.k_scale[i], self.v_scale[i]) if self.k_scale else (None, None)


@dataclass(frozen=True)
class EngineConfig:
    max_len: int = 4096  # KV positions per row, capped at the model's context
    use_graphs: bool = True
    prefill_graphs: bool = True  # a repeated short prefill shape replays a graph (PREFILL_GRAPH_TOKENS); needs use_graphs
    kv_int8: bool = False  # int8 KV cache with a scale per (row, head, position): half the cache bytes
    fold_norms: bool = True  # small decode batches (fp16, AWQ: FOLD_MAX_ROWS; int8: 16 rows): norms deferred into GEMVs
    fuse_rope: bool = True  # decode: RoPE and the new token's K/V write inside the attention kernel (no rope_kv)
    # int8 decode of up to XQ_MAX_ROWS (1) rows with dynamic activations: the SwiGLU in the gate|up GEMV's epilogue,
    # and o_proj / down_proj quantizing their inputs themselves (int8_gemm.DeferredQuant; the same bits)
    defer_int8_quant: bool = True
    # the lm_head as int8 codes with an fp32 scale per vocabulary row (calibrate.int8, computed at load from the fp16
    # head), fp16 activations (fp16_gemv.cu's w8a16 entries): what a decode step reads of it halves (LLaMA-2-7B:
    # 262 -> 131 MB a step). What it costs (SmolLM2-135M, 16,352 tokens of `fllama eval --lm-head-int8 --baseline`,
    # docs/quality.md): KL 8.5e-4 nats a token, perplexity +0.05%, top-1 agreement 97.8%
    lm_head_int8: bool = False


class Engine:
    """fp16 / int8 / awq checkpoint on the GPU; forward(tokens, cache, rows) -> fp32 logits like the reference."""

    name = "engine"

    def __init__(self, weights: ModelWeights, cfg: EngineConfig = EngineConfig()):
        build.require_cuda()
        self.cfg = cfg
        self.config: LlamaConfig = weights.config
        self._device = torch.device("cuda", torch.cuda.current_device())
        self.scheme = weights.meta.get("scheme", "fp16")
        dev = self._device
        with build.on_stream():
            self.embed = weights.embed.to(dev, torch.float16).contiguous()  # [V, H]
            self.lm_head = self.embed if self.config.tie_embeddings else weights.lm_head.to(dev, torch.float16).contiguous()
            self.lm_head_q: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes int8 [V, H], scales fp32 [V])
            if cfg.lm_head_int8:
                self._lm_head_int8()
                if self.lm_head is not self.embed:
                    self.lm_head = None  # the fp16 head is not kept (a tied one is the embedding table)
            self.norm = weights.norm.to(dev, torch.float16).contiguous()
            self.layers = [self._gpu_layer(l, dev) for l in weights.layers]
            self.max_len = min(cfg.max_len, self.config.max_positions)
            self.cos_sin = rope_table(self.config.head_dim, self.config.rope_theta, self.config.max_positions + 1, dev)
        self._caches: dict[tuple[int, bool], GpuCache] = {}
        self._samplers: dict[int, GpuSampler] = {}
        self._prefill_capture_failed = False
        build.synchronize()

    # -- construction -----------------------------------------------------------------------------------
    @staticmethod
    def _gpu_layer(l: Any, dev: torch.device) -> GpuLayer:
        down = _fuse([l.w_down], dev)
        # an int8 down_proj takes its input quantized by silu_mul_quant, so its gate|up stays unfused
        return GpuLayer(attn_norm=l.attn_norm.to(dev, torch.float16).contiguous(),
                        ffn_norm=l.ffn_norm.to(dev, torch.float16).contiguous(),
                        qkv=_fuse([l.wq, l.wk, l.wv], dev), o=_fuse([l.wo], dev),
                        gate_up=_fuse([l.w_gate, l.w_up], dev, swiglu=not down.int8), down=down)

    @classmethod
    def from_loaded(cls, loaded: Any, cfg: EngineConfig = EngineConfig()) -> "Engine":
        from fllama_cli.runtime import build_weights

        return cls(build_weights(loaded, torch.float16, "cpu"), cfg)

    @classmethod
    def from_checkpoint(cls, path: str, cfg: EngineConfig = EngineConfig()) -> "Engine":
        from model_zoo.load import load_model

        return cls.from_loaded(load_model(path, dtype=torch.float16), cfg)

    @property
    def device(self) -> torch.device:
        return self._device

    def weight_bytes(self) -> int:
        """Bytes of the weights held on the GPU."""
        n = self.embed.numel() * 2 + self._body_bytes()
        if self.lm_head is not None and self.lm_head is not self.embed:
            n += self.lm_head.numel() * 2
        if self.lm_head_q is not None:
            n += sum(t.numel() * t.element_size() for t in self.lm_head_q)
        return n

    def step_weight_bytes(self, batch: int) -> int:
        """Bytes of weights one decode step of `batch` rows reads: the layers, the final norm, the lm_head as it runs
        (fp16, or its int8 codes and scales) and the embedding rows looked up."""
        c = self.config
        head = c.vocab_size * (c.hidden_size + 4 if self.cfg.lm_head_int8 else 2 * c.hidden_size)  # codes + scales
        return self._body_bytes() + head + c.hidden_size * 2 * batch

    def _body_bytes(self) -> int:
        n = self.norm.numel() * 2
        for l in self.layers:
            n += (l.attn_norm.numel() + l.ffn_norm.numel()) * 2
            n += sum(op.nbytes() for op in (l.qkv, l.o, l.gate_up, l.down))
        return n

    def _lm_head_fp16(self) -> torch.Tensor:
        if self.lm_head is None:
            raise DeviceError("this engine holds the lm_head as int8 only (it was built with lm_head_int8)")
        return self.lm_head

    def _lm_head_int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [V, H], scales fp32 [V]) of the fp16 lm_head, made on first use (an A/B that switches
        lm_head_int8 on keeps the fp16 head beside them)."""
        if self.lm_head_q is None:
            w = self._lm_head_fp16()  # [V, H]
            with build.on_stream():
                q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
                s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
                for v0 in range(0, w.shape[0], LM_HEAD_QUANT_ROWS):  # fp32 temporaries of a chunk, not of the head
                    q[v0:v0 + LM_HEAD_QUANT_ROWS], s[v0:v0 + LM_HEAD_QUANT_ROWS] = quantize_weight_int8(
                        w[v0:v0 + LM_HEAD_QUANT_ROWS])
            self.lm_head_q = (q, s)
        return self.lm_head_q

    def kv_position_bytes(self) -> int:
        """Bytes of one position of one row's K and V over all layers and KV heads."""
        c = self.config
        per_head = c.head_dim + 4 if self.cfg.kv_int8 else c.head_dim * 2  # int8 codes + an fp32 scale
        return 2 * c.n_layers * c.n_kv_heads * per_head

    def kv_bytes(self, batch: int, max_len: int) -> int:
        return batch * (max_len + 1) * self.kv_position_bytes()

    def memory_report(self) -> dict:
        caches = {f"{b}{'-scratch' if s else ''}": self.kv_bytes(b, c.capacity) for (b, s), c in self._caches.items()}
        return {"weights_bytes": self.weight_bytes(), "kv_cache_bytes": caches,
                "allocated_bytes": torch.cuda.memory_allocated(self._device),
                "peak_bytes": torch.cuda.max_memory_allocated(self._device)}

    # -- cache ------------------------------------------------------------------------------------------
    @_api
    def new_cache(self, batch: int, max_len: int, scratch: bool = False) -> GpuCache:
        """The bucket's cache, emptied (its decode graph is kept: same buffers, same pointers).

        One cache per bucket: a new_cache of the same bucket empties the previous one. `scratch` caches
        (forward without a cache, as eval does) are separate, so they never clobber a conversation."""
        if batch > BUCKETS[-1]:
            raise DeviceError(f"batch {batch} is above the engine's largest bucket {BUCKETS[-1]}")
        if max_len > self.config.max_positions:
            raise PromptError(f"{max_len} positions exceed the model's context of {self.config.max_positions}")
        bucket = next(b for b in BUCKETS if b >= batch)
        key = (bucket, scratch)
        cache = self._caches.get(key)
        if cache is None or cache.capacity < max_len:
            self._caches.pop(key, None)  # free the old storage (and its graph) first
            cache = self._alloc_cache(bucket, max(max_len, min(self.max_len, self.config.max_positions)))
            self._caches[key] = cache
        cache.lengths.zero_()
        cache.max_len, cache.batch = max_len, batch
        return cache

    def _alloc_cache(self, bucket: int, cap: int) -> GpuCache:
        c = self.config
        shape = (bucket, c.n_kv_heads, cap + 1, c.head_dim)
        need = self.kv_bytes(bucket, cap)
        free = torch.cuda.mem_get_info(self._device)[0]
        if need > free:
            raise DeviceError(f"the KV cache for batch {bucket} x {cap} positions needs {need / 2**30:.1f} GiB but "
                              f"{free / 2**30:.1f} GiB are free: lower the batch or the context")
        dtype = torch.int8 if self.cfg.kv_int8 else torch.float16
        with build.on_stream():
            k = [torch.zeros(shape, dtype=dtype, device=self._device) for _ in range(c.n_layers)]
            v = [torch.zeros(shape, dtype=dtype, device=self._device) for _ in range(c.n_layers)]
            scales = [[torch.zeros(shape[:3], dtype=torch.float32, device=self._device) for _ in range(c.n_layers)]
                      for _ in range(2)] if self.cfg.kv_int8 else [[], []]
            lengths = torch.zeros(bucket, dtype=torch.int32, device=self._device)
        return GpuCache(k=k, v=v, lengths=lengths, max_len=cap, batch=bucket, k_scale=scales[0], v_scale=scales[1])

    # -- the layer ---------------------------------------------------------------------------------------
    def _norm_in(self, h: torch.Tensor, w: torch.Tensor, op: Any, fold: FoldOut | None,
                 zero: torch.Tensor | None = None) -> tuple[Any, FoldIn | None]:
        """op's input after the RMSNorm with weight w and how op takes it: the norm kernel's output (+ int8
        quantization for an int8 op) and None, or, when a producer deferred this norm (fold), its xg and FoldIn
        (for an int8 op: a NormQuant, which op's GEMV quantizes at one row and quantize_fold otherwise, and None;
        zero: a buffer the quantizing kernel clears, for a later GEMV)."""
        eps = self.config.norm_eps
        if fold is not None and fold.int8:  # xg quantized from the producer's maxima and sums (no norm kernel)
            nq = NormQuant(fold.xg, fold.mx, fold.part, eps, op.amax, zero, early=_early_fold(h.shape[0]))
            return (nq if nq.in_loop() else nq.quantized()), None
        if zero is not None:
            raise DeviceError("a row-max buffer is cleared by the int8 deferred norm's quantization only")
        if fold is not None:
            return fold.xg, fold.consumer(eps)
        return (rmsnorm_quant(h, w, eps, op.amax) if op.int8 else rmsnorm(h, w, eps)), None

    def _folds(self, m: int) -> bool:
        """Whether a decode step of m rows defers its RMSNorms into the kernels around them (norm_fold.py):
        up to the scheme's FOLD_MAX_ROWS, every linear on a GEMV that takes the fold, the lm_head on fp16_gemv."""
        if not self.cfg.fold_norms or not norm_fold.takes(self.config.hidden_size):
            return False
        if m > min(FOLD_MAX_ROWS.get(self.scheme, 0), DECODE_MAX_M):
            return False
        return all(op.folds(m) for l in self.layers for op in (l.qkv, l.o, l.gate_up, l.down))

    def _defers_quant(self, m: int) -> bool:
        """Whether a decode step of m rows defers the int8 quantizations of the o_proj and down_proj inputs into
        those GEMVs (int8 checkpoints with dynamic activations, up to XQ_MAX_ROWS rows, RoPE in attention)."""
        if not (self.cfg.defer_int8_quant and self.cfg.fuse_rope) or m > XQ_MAX_ROWS:
            return False
        return all(l.o.int8 and l.gate_up.int8 and l.down.int8 and l.o.amax is None and l.down.amax is None
                   for l in self.layers)

    def _folds_int8(self, m: int) -> bool:
        """Whether an int8 decode step of m rows defers its RMSNorms (FOLD_INT8): up to the GEMVs' DECODE_MAX_M
        rows, where o_proj and down_proj are the int8 GEMVs that write the next norm's inputs."""
        if not (self.cfg.fold_norms and FOLD_INT8 and norm_fold.takes(self.config.hidden_size)):
            return False
        return m <= DECODE_MAX_M and all(op.int8 for l in self.layers for op in (l.qkv, l.o, l.gate_up, l.down))

    def _layer(self, i: int, h: torch.Tensor, cache: GpuCache, attend, fold: FoldOut | None = None,
               defer: bool = False, int8_fold: bool = False) -> tuple[torch.Tensor, FoldOut | None]:
        """h [T, H] fp16 -> (h [T, H], fold); attend(i, qkv [T, (nh + 2 nkv) d]) -> [T, nh * d] (RoPE, the
        K/V cache write and attention: one kernel in decode, rope_kv + SDPA in prefill).

        fold: h's deferred attn_norm (a folded decode step, norm_fold.py). The layer then defers its ffn_norm
        too and returns the norm deferred after it (the next layer's attn_norm, or the final norm).
        defer: an int8 decode step whose down_proj quantizes its input (_defers_quant): the gate|up GEMV applies
        the SwiGLU. attend(...) may return a DeferredQuant for o_proj likewise.
        int8_fold: an int8 decode step that defers its norms (_folds_int8): o_proj and down_proj write the
        ffn_norm's and the next layer's attn_norm's inputs (the embedding writes layer 0's; the final norm runs as a
        kernel)."""
        c, L = self.config, self.layers[i]
        T = h.shape[0]
        # [T] the SwiGLU GEMV's row maxima (SWIGLU_ROW_AMAX), cleared by the kernel that quantizes a norm before
        # it: the quantize_fold before gate|up, or where the GEMVs quantize one row's norm themselves (that GEMV
        # cannot clear what its own blocks accumulate), q|k|v
        row_amax = cache.static["row_amax"] if defer and int8_fold and SWIGLU_ROW_AMAX else None
        qkv_clears = row_amax is not None and norm_in_loop(T)
        x, fold_in = self._norm_in(h, L.attn_norm, L.qkv, fold, zero=row_amax if qkv_clears else None)
        qkv = L.qkv(x, fold_in=fold_in)  # [T, (nh + 2 nkv) d]
        o = attend(i, qkv)  # [T, nh * d], (q int8, a_scale) when attention quantized its output, or DeferredQuant
        if L.o.int8 and isinstance(o, torch.Tensor):
            o = quantize(o, L.o.amax)
        folding = fold is not None or int8_fold
        ffn = FoldOut.new(L.ffn_norm, T, int8_fold) if folding else None
        h = L.o(o, residual=h, fold_out=ffn)  # [T, H]
        x, fold_in = self._norm_in(h, L.ffn_norm, L.gate_up, ffn, zero=None if qkv_clears else row_amax)
        if L.gate_up.swiglu:
            a = L.gate_up(x, fold_in=fold_in)  # [T, F]: the GEMV's epilogue applied silu(gate) * up
        elif defer:
            a = L.gate_up.swiglu_deferred(x, row_amax)  # DeferredQuant: silu(gate) * up [T, F] and its row maxima
        elif L.gate_up.int8 and L.down.int8 and T <= SWIGLU_INT8_ROWS and SWIGLU_INT8_GEMV:
            d = L.gate_up.swiglu_deferred(x)  # the GEMV's SwiGLU epilogue and its maxima per 8 channels
            a = quantize_fold(d.x, d.part, None, 0.0, L.down.amax, early=_early_fold(T))  # silu_mul_quant's bits
        else:
            gu = L.gate_up(x, fold_in=fold_in)  # [T, 2F]
            a = silu_mul_quant(gu, L.down.amax) if L.down.int8 else silu_mul(gu)  # [T, F]
        nxt = None
        if folding and not (int8_fold and i + 1 == c.n_layers):  # int8's final norm stays a kernel
            nxt = FoldOut.new(self.layers[i + 1].attn_norm if i + 1 < c.n_layers else self.norm, T, int8_fold)
        return L.down(a, residual=h, fold_out=nxt), nxt  # [T, H]

    def _rope(self, i: int, qkv: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, cache: GpuCache) -> torch.Tensor:
        """RoPE on q and k of qkv, k and v written to layer i's cache at (row, pos): the rotated q [T, nh, d]."""
        c = self.config
        ks, vs = cache.scales(i)
        return rope_kv(qkv, self.cos_sin, pos, row, cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads, k_scale=ks,
                       v_scale=vs)

    def _logits(self, h: torch.Tensor, fold: FoldOut | None = None) -> torch.Tensor:
        if fold is not None:  # the final norm deferred into the lm_head GEMV
            x, fold_in = fold.xg, fold.consumer(self.config.norm_eps)
        else:
            x, fold_in = rmsnorm(h, self.norm, self.config.norm_eps), None  # [T, H]
        if self.cfg.lm_head_int8:
            return w8a16_linear(x, *self._lm_head_int8(), fold_in=fold_in)  # [T, V] fp16
        return fp16_linear(x, self._lm_head_fp16(), fold_in=fold_in)  # [T, V] fp16

    # -- forward -----------------------------------------------------------------------------------------
    @_api
    def forward(self, tokens: torch.Tensor, cache: GpuCache | None = None,
                rows: torch.Tensor | None = None, *, prefill_graph: bool = True) -> torch.Tensor:
        """tokens [B, S] -> fp32 logits [B, S, V]; with a cache each row continues at its own length.
        prefill_graph=False: a prefill runs eagerly even when its shape has a graph (benchmarks: a new prompt's
        time to first token)."""
        B, S = tokens.shape
        if cache is None:
            cache = self.new_cache(B, S, scratch=True)
        rows_l = list(range(B)) if rows is None else [int(r) for r in rows]
        if S == 1:  # decode kernels (graph replay, or the same kernels eagerly with use_graphs off)
            return self._decode(tokens[:, 0], cache, rows_l)[:, None]
        return self._prefill(tokens, cache, rows_l, prefill_graph)

    def _prefill(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int], graph_ok: bool = True) -> torch.Tensor:
        """Eager, or the replay of a graph captured the second time the same prefill shape comes (rows, length,
        starts): PREFILL_GRAPH_TOKENS."""
        B, S = tokens.shape
        with build.on_stream():
            idx = torch.tensor(rows, device=self._device)  # [B]
        starts = cache.lengths[idx].tolist()
        if max(starts) + S > cache.capacity:
            raise PromptError(f"the KV cache holds {cache.capacity} positions; {max(starts) + S} are needed")
        key = (tuple(rows), S, tuple(starts))

        def eager() -> torch.Tensor:
            return self._prefill_body(*self._prefill_inputs(tokens, starts, rows), idx, cache, rows, starts)

        if not (graph_ok and self.cfg.use_graphs and self.cfg.prefill_graphs and B * S <= PREFILL_GRAPH_TOKENS
                and not self._prefill_capture_failed):
            return eager()
        graphs = cache.prefill_graphs
        entry = graphs.get(key)
        if entry is None:
            if key not in cache.prefill_seen:  # a shape seen once runs eagerly: most never come again (chat turns)
                if len(cache.prefill_seen) >= PREFILL_SEEN_MAX:
                    cache.prefill_seen.clear()
                cache.prefill_seen.add(key)
                return eager()
            try:
                entry = graphs[key] = self._capture_prefill(tokens, cache, rows, starts, idx)
            except (DeviceError, RuntimeError):  # an op that cannot be captured: this engine's prefills stay eager
                if os.environ.get("FLLAMA_DEBUG") == "1":
                    raise
                self._prefill_capture_failed = True  # capturing ran nothing: the cache is as it was
                return eager()
            while len(graphs) > PREFILL_GRAPHS:
                graphs.popitem(last=False)  # the least recently used
        graphs.move_to_end(key)
        graph, ids, out, _ = entry
        with build.on_stream():
            ids.copy_(tokens.reshape(-1))  # [T] int32 on the GPU: the graph's one input that changes
            graph.replay()
            return out.clone()  # the graph's output is overwritten by its next replay

    def _prefill_inputs(self, tokens: torch.Tensor, starts: list[int],
                        rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and cache rows of a prefill, flattened [T] int32 on the GPU."""
        S = tokens.shape[1]
        dev = self._device
        with build.on_stream():
            ids = tokens.to(dev, torch.int32).reshape(-1).contiguous()  # [T]
            pos = torch.cat([torch.arange(s, s + S, dtype=torch.int32) for s in starts]).to(dev)  # [T]
            row = torch.tensor(rows, dtype=torch.int32).repeat_interleave(S).to(dev)  # [T]
        return ids, pos, row

    def _prefill_body(self, ids: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, idx: torch.Tensor,
                      cache: GpuCache, rows: list[int], starts: list[int]) -> torch.Tensor:
        """The prefill's kernels, from device inputs only (so a graph can capture them): fp32 logits [B, S, V]."""
        B, S = len(rows), ids.shape[0] // len(rows)
        c = self.config
        with build.on_stream():
            h = embedding(self.embed, ids)  # [T, H]

            def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:  # qkv [T, (nh + 2 nkv) d]
                q = self._rope(i, qkv, pos, row, cache)  # [T, nh, d]
                outs = [attention_prefill(q[b * S:(b + 1) * S], cache.k[i], cache.v[i], r, starts[b], *cache.scales(i))
                        for b, r in enumerate(rows)]  # each [S, nh, d]
                return (outs[0] if B == 1 else torch.cat(outs)).reshape(B * S, c.q_size)  # no copy for one row

            for i in range(c.n_layers):
                h, _ = self._layer(i, h, cache, attend)
            logits = self._logits(h).float().reshape(B, S, -1)  # [B, S, V]
            cache.lengths[idx] += S
        return logits

    def _capture_prefill(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int], starts: list[int],
                         idx: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, tuple]:
        """(graph, its ids input [T], its logits [B, S, V], the other inputs it reads) of this prefill shape: the
        graph holds their addresses, so the entry keeps them alive. Capturing runs nothing, so the cache and
        lengths are untouched until the replay; the eager run of the shape's first occurrence built the kernels
        and warmed cuBLAS and SDPA up."""
        ids, pos, row = self._prefill_inputs(tokens, starts, rows)
        graph, out = _record(lambda: self._prefill_body(ids, pos, row, idx, cache, rows, starts))
        return graph, ids, out, (pos, row, idx)

    def _decode(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int],
                sampler: "GpuRowSampler | None" = None) -> torch.Tensor:
        """One token for each of `rows`: logits [len(rows), V], or with a sampler the sampled ids [len(rows)].

        Replays the bucket's graph (captured on first use, with or without sampling), or runs the same
        kernels eagerly when graphs are off."""
        with build.on_stream():
            idx = torch.tensor(rows, device=self._device)
            if int(cache.lengths[idx].max()) + 1 > cache.capacity:
                raise PromptError(f"the KV cache holds {cache.capacity} positions; a row is full")
            if not cache.static:
                cache.static = {"tokens": torch.zeros(cache.bucket, dtype=torch.int32, device=self._device),
                                "active": torch.zeros(cache.bucket, dtype=torch.int32, device=self._device),
                                "row": torch.arange(cache.bucket, dtype=torch.int32, device=self._device),
                                # attention's lengths (lengths + 1), written by the step's embedding kernel
                                "lens": torch.zeros(cache.bucket, dtype=torch.int32, device=self._device),
                                # the int8 SwiGLU GEMV's row maxima (SWIGLU_ROW_AMAX)
                                "row_amax": torch.zeros(cache.bucket, dtype=torch.float32, device=self._device)}
            st = cache.static
            st["tokens"][idx] = tokens.to(self._device, torch.int32)
            st["active"].zero_()
            st["active"][idx] = 1
        key = "sampled" if sampler is not None else "logits"
        if not self.cfg.use_graphs:
            with build.on_stream():
                out = self._step_body(cache, sampler.gpu if sampler else None)
        else:
            if cache.graphs.get(key) is None:
                cache.graphs[key] = self._capture(cache, sampler.gpu if sampler else None)
            graph, out = cache.graphs[key]
            with build.on_stream():
                graph.replay()
        with build.on_stream():
            return out[idx].long() if sampler is not None else out[idx].float()

    @_api
    def decode_sampled(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int],
                       sampler: "GpuRowSampler") -> torch.Tensor:
        """Decode and sample on the GPU in one graph replay: the next token of each row [len(rows)]."""
        return self._decode(tokens, cache, rows, sampler)

    def _step_body(self, cache: GpuCache, sampler: GpuSampler | None) -> torch.Tensor:
        st = cache.static
        logits = self._decode_body(cache, advance=sampler is None)  # [Bb, V] fp16
        if sampler is None:
            return logits
        # the sampler also feeds the next replay its input ids (benchmarks replay without the host) and advances
        # the rows that decoded
        return sampler.sample(logits, StepState(st["tokens"], cache.lengths, st["active"]))  # [Bb] int32, sampler.out

    def _decode_body(self, cache: GpuCache, advance: bool) -> torch.Tensor:
        """The step's logits; `advance`: the lengths of the rows that decoded grow by one here (else the sampler
        does it)."""
        st = cache.static
        pos = cache.lengths  # the new token's position, per row
        lens = st["lens"]  # [Bb] attention covers the new token: lengths + 1, written by the embedding kernel
        step_lens = (cache.lengths, lens)
        c = self.config
        fold = None
        defer = self._defers_quant(cache.bucket)
        defer_o, defer_down = defer and DEFER_ATTENTION, defer and DEFER_SWIGLU
        int8_fold = self._folds_int8(cache.bucket)
        if self._folds(cache.bucket) or int8_fold:  # RMSNorms deferred into the GEMVs (norm_fold.py)
            h, fold = embedding_fold(self.embed, st["tokens"], self.layers[0].attn_norm, step_lens=step_lens,
                                     int8=int8_fold)  # [Bb, H]
        else:
            h = embedding(self.embed, st["tokens"], step_lens=step_lens)  # [Bb, H]

        def attend(i: int, qkv: torch.Tensor):
            o_op = self.layers[i].o
            k, v, (ks, vs) = cache.k[i], cache.v[i], cache.scales(i)
            if self.cfg.fuse_rope:  # row b is cache row b (st["row"] is the identity) at position lens - 1 = pos
                if defer_o:  # o_proj quantizes attention's output itself, from each unit's max |out|
                    return DeferredQuant(*attention_decode_rope_parts(qkv, self.cos_sin, k, v, lens, c.n_heads, ks, vs))
                if o_op.int8:  # one kernel: RoPE, the K/V write, attention and the o_proj input's quantization
                    return attention_decode_rope_quant(qkv, self.cos_sin, k, v, lens, c.n_heads, o_op.amax, ks, vs)
                return attention_decode_rope(qkv, self.cos_sin, k, v, lens, c.n_heads, ks, vs).reshape(-1, c.q_size)
            q = self._rope(i, qkv, pos, st["row"], cache)  # [Bb, nh, d]
            if o_op.int8:
                return attention_decode_quant(q, k, v, lens, o_op.amax, ks, vs)
            return attention_decode(q, k, v, lens, ks, vs).reshape(-1, c.q_size)

        for i in range(c.n_layers):
            h, fold = self._layer(i, h, cache, attend, fold, defer_down, int8_fold)
        logits = self._logits(h, fold)  # [Bb, V] fp16
        if advance:
            cache.lengths.add_(st["active"])  # only rows that decoded this step advance
        return logits

    def _capture(self, cache: GpuCache, sampler: GpuSampler | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with build.on_stream():
            # warm-up (builds kernels, allocates) must leave no trace: it writes K/V only where this step will
            # write them again, and everything else it changes is put back
            state = [cache.lengths, cache.static["tokens"]]
            if sampler is not None:
                state += [sampler.seen, sampler.rng, sampler.finished]
            saved = [t.clone() for t in state]
            self._step_body(cache, sampler)
            for t, v in zip(state, saved):
                t.copy_(v)
        return _record(lambda: self._step_body(cache, sampler))

    @_api
    def replay_steps(self, cache: GpuCache, steps: int, sampled: bool = True) -> None:
        """Replay the captured decode step `steps` times with no host work in between (benchmarks)."""
        graph, _ = cache.graphs["sampled" if sampled else "logits"]
        with build.on_stream():
            for _ in range(steps):
                graph.replay()

    # -- sampling ------------------------------------------------------------------------------------------
    @_api
    def make_sampler(self, cfg: SamplingConfig, batch: int) -> "GpuRowSampler":
        """The bucket's sampler, reconfigured: its buffers persist so the sampled decode graph stays valid."""
        bucket = next(b for b in BUCKETS if b >= batch)
        gpu = self._samplers.get(bucket)
        with build.on_stream():
            if gpu is None:
                # the loop decides when a row ends, so the kernel's own EOS tracking gets an id that never occurs
                gpu = self._samplers[bucket] = GpuSampler(bucket, self.config.vocab_size, eos_ids=[-1],
                                                          device=self._device)
            gpu.set_config(cfg)
            gpu.reset(cfg.seed if cfg.seed is not None else fresh_seed())
        return GpuRowSampler(gpu)


class GpuRowSampler:
    """The generation loop's sampler interface over a bucket's GpuSampler (device RNG, seen mask, penalties)."""

    def __init__(self, gpu: GpuSampler):
        self.gpu = gpu
        with build.on_stream():
            self.logits = torch.zeros(gpu.batch, gpu.vocab, dtype=torch.float32, device=gpu.out.device)  # [Bb, V]

    @_api
    def observe(self, row: int, tokens: list[int]) -> None:
        with build.on_stream():
            self.gpu.observe(row, tokens)

    @_api
    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        with build.on_stream():
            idx = torch.tensor(rows, device=self.logits.device)
            self.logits[idx] = logits.float()
            out = self.gpu.sample(self.logits)  # [B] int32; rows not asked for are ignored
            return out[idx].long()

