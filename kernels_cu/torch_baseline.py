"""The speed to beat: the reference model in fp16 under torch.compile with CUDA graphs (gpt-fast style).

ReferenceModel keeps one length per row and reads positions back to the host, which torch.compile cannot
turn into one static graph. StaticKVDecoder is the same math (model_zoo.reference's rms_norm, RoPE and
apply_rope; SwiGLU) with static shapes: every row sits at the same positions, the cache is written with
index_copy_ at `input_pos` and attention always spans the whole cache under a boolean mask, so no tensor
value ever reaches Python. q|k|v and gate|up are fused into one weight each, as gpt-fast does.

`time_baseline` is what `fllama bench` reports beside the engine; it needs CUDA.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.errors import ConfigError, DeviceError
from model_zoo.reference import apply_rope, rms_norm, rope_cos_sin
from model_zoo.weights import LayerWeights, ModelWeights

CACHE_MULTIPLE = 16  # time_baseline rounds the cache up so SDPA's masked kernels see aligned rows
WARMUP_STEPS = 3  # decode calls before timing: cudagraph trees warm up, then record, then replay


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _Block(nn.Module):
    """One decoder layer's fused weights and its slice of the KV cache (buffers: cudagraphs may mutate them)."""

    def __init__(self, layer: LayerWeights, cache_shape: tuple[int, ...], dtype: torch.dtype, device):
        super().__init__()
        move = dict(device=device, dtype=dtype)
        self.attn_norm = _frozen(layer.attn_norm.to(**move))  # [H]
        self.ffn_norm = _frozen(layer.ffn_norm.to(**move))  # [H]
        qkv = [lin.dense_weight().to(**move) for lin in (layer.wq, layer.wk, layer.wv)]
        self.wqkv = _frozen(torch.cat(qkv))  # [q_size + 2 kv_size, H]
        self.wo = _frozen(layer.wo.dense_weight().to(**move))  # [H, q_size]
        gate_up = [lin.dense_weight().to(**move) for lin in (layer.w_gate, layer.w_up)]
        self.w_gate_up = _frozen(torch.cat(gate_up))  # [2F, H]
        self.w_down = _frozen(layer.w_down.dense_weight().to(**move))  # [H, F]
        self.register_buffer("k_cache", torch.zeros(cache_shape, **move))  # [B, n_kv, L, d]
        self.register_buffer("v_cache", torch.zeros(cache_shape, **move))  # [B, n_kv, L, d]


class StaticKVDecoder(nn.Module):
    """forward(tokens [B, S], input_pos [S]) -> fp32 logits [B, S, V]; all rows at the same positions."""

    def __init__(self, weights: ModelWeights, batch: int, max_len: int, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cuda"):
        super().__init__()
        c = self.config = weights.config
        if batch <= 0 or max_len <= 0:
            raise ConfigError(f"batch and max_len must be positive, got {batch} and {max_len}")
        self.batch, self.max_len = batch, max_len
        cache_shape = (batch, c.n_kv_heads, max_len, c.head_dim)
        self.layers = nn.ModuleList(_Block(layer, cache_shape, dtype, device) for layer in weights.layers)
        self.embed = _frozen(weights.embed.to(device=device, dtype=dtype))  # [V, H]
        # tied embeddings stay one tensor (nn.Module dedups the shared parameter)
        self.lm_head = self.embed if c.tie_embeddings else _frozen(weights.lm_head.to(device=device, dtype=dtype))
        self.norm = _frozen(weights.norm.to(device=device, dtype=dtype))  # [H]
        key_pos = torch.arange(max_len, device=device)  # [L]
        cos, sin = rope_cos_sin(c, key_pos, dtype)  # [L, d] each: fp32 math, cast, as the reference does
        self.register_buffer("key_pos", key_pos)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def reset(self) -> None:
        """Zero the KV cache (in place: compiled graphs keep pointing at the same memory)."""
        for block in self.layers:
            block.k_cache.zero_()
            block.v_cache.zero_()

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, last: bool = False) -> torch.Tensor:
        B, S = tokens.shape
        if B != self.batch or S > self.max_len:  # static shapes: Python ints, no host sync
            raise ConfigError(f"tokens {tuple(tokens.shape)} do not fit a decoder of batch {self.batch} "
                              f"and {self.max_len} positions")
        cos, sin = self.rope_cos[input_pos][None], self.rope_sin[input_pos][None]  # [1, S, d]
        mask = self.key_pos <= input_pos[:, None]  # [S, L]: causal over the whole cache
        x = F.embedding(tokens, self.embed)  # [B, S, H]
        for block in self.layers:
            x = self._layer(block, x, input_pos, cos, sin, mask)
        x = rms_norm(x[:, -1:] if last else x, self.norm, self.config.norm_eps)  # last: the prompt's next token only
        return F.linear(x, self.lm_head).float()  # [B, S or 1, V]

    def _layer(self, block: _Block, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, S, _ = x.shape
        h = rms_norm(x, block.attn_norm, c.norm_eps)  # [B, S, H]
        q, k, v = F.linear(h, block.wqkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(B, S, c.n_heads, c.head_dim).transpose(1, 2)  # [B, nh, S, d]
        k = k.view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
        v = v.view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # [B, n_kv, S, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        block.k_cache.index_copy_(2, input_pos, k)
        block.v_cache.index_copy_(2, input_pos, v)
        o = F.scaled_dot_product_attention(q, block.k_cache, block.v_cache, attn_mask=mask,
                                           enable_gqa=c.gqa_ratio > 1)  # [B, nh, S, d]
        x = x + F.linear(o.transpose(1, 2).reshape(B, S, c.q_size), block.wo)
        h = rms_norm(x, block.ffn_norm, c.norm_eps)
        gate, up = F.linear(h, block.w_gate_up).chunk(2, dim=-1)  # [B, S, F] each
        return x + F.linear(F.silu(gate) * up, block.w_down)


def compiled_decode_step(decoder: StaticKVDecoder) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """tokens [B, 1], input_pos [1] -> logits [B, 1, V], replayed as a CUDA graph.

    The returned logits live in the graph's memory and are overwritten by the next call: consume or
    clone them first."""
    step = torch.compile(decoder.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def decode(tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()  # each call is a new iteration of the graph tree
        return step(tokens, input_pos)

    return decode


def compiled_prefill(decoder: StaticKVDecoder) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """tokens [B, S], input_pos [S] -> the last position's logits [B, 1, V] (what generation reads, as the engine's
    prefill computes); compiled, no CUDA graph (one call per prompt)."""
    return torch.compile(functools.partial(decoder.forward, last=True), fullgraph=True, dynamic=False)


WeightsSource = Union[ModelWeights, Callable[[], ModelWeights]]


def time_baseline(weights_or_factory: WeightsSource, batch: int, prompt_len: int, gen_len: int, repeat: int,
                  device: torch.device | str = "cuda") -> dict:
    """Prefill and greedy decode timings of the compiled fp16 baseline (CUDA events, medians over repeats).

    A factory is called once and its ModelWeights dropped after the fused copies exist, which lowers the
    peak memory. Returns prefill_s, prefill_tok_s, decode_ms_median, decode_ms_p90, decode_tok_s, compile_s.
    Resets torch._dynamo before and after: every call compiles new graphs of the same `forward` (the
    recompile limit would send later calls to eager), and the CUDA-graph pools would keep this decoder's
    weights alive while the engine is measured next.
    """
    device = _cuda_device(device)
    if min(batch, prompt_len, gen_len, repeat) <= 0:
        raise ConfigError(f"batch, prompt_len, gen_len and repeat must be positive, got "
                          f"{batch}, {prompt_len}, {gen_len}, {repeat}")
    torch._dynamo.reset()
    try:
        return _measure(weights_or_factory, batch, prompt_len, gen_len, repeat, device)
    finally:
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _measure(weights_or_factory: WeightsSource, batch: int, prompt_len: int, gen_len: int, repeat: int,
             device: torch.device) -> dict:
    weights = weights_or_factory() if callable(weights_or_factory) else weights_or_factory
    max_len = -(-(prompt_len + gen_len) // CACHE_MULTIPLE) * CACHE_MULTIPLE
    decoder = StaticKVDecoder(weights, batch, max_len, torch.float16, device)
    vocab = weights.config.vocab_size
    del weights
    prefill, step = compiled_prefill(decoder), compiled_decode_step(decoder)
    prompt = torch.randint(0, vocab, (batch, prompt_len), device=device)  # [B, S]
    with torch.no_grad():
        t0 = time.perf_counter()
        _generate(prefill, step, prompt, min(WARMUP_STEPS, max_len - prompt_len))  # compile, warm up, record
        torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
        prefill_times, step_times = [], []
        for _ in range(repeat):
            p, steps = _generate(prefill, step, prompt, gen_len)
            prefill_times.append(p)
            step_times += steps
    prefill_s = statistics.median(prefill_times)
    step_times.sort()
    med = statistics.median(step_times)
    p90 = step_times[min(len(step_times) - 1, int(0.9 * len(step_times)))]
    return {"prefill_s": prefill_s, "prefill_tok_s": batch * prompt_len / prefill_s,
            "decode_ms_median": med * 1e3, "decode_ms_p90": p90 * 1e3, "decode_tok_s": batch / med,
            "compile_s": compile_s}


def _generate(prefill, step, prompt: torch.Tensor, n_steps: int) -> tuple[float, list[float]]:
    """Prefill then n_steps greedy decode steps, argmax on the device; (prefill s, per-step s) from events."""
    B, S = prompt.shape
    prompt_pos = torch.arange(S, device=prompt.device)  # [S]
    pos = torch.full((1,), S, dtype=torch.long, device=prompt.device)  # [1]: the first decode position
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n_steps + 2)]
    events[0].record()
    tok = prefill(prompt, prompt_pos)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    events[1].record()
    for i in range(n_steps):
        # argmax makes a fresh tensor, so the graph's logits buffer is free for the next replay
        tok = step(tok, pos)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        pos = pos + 1  # [1], on the device: no host sync
        events[i + 2].record()
    events[-1].synchronize()
    times = [a.elapsed_time(b) / 1e3 for a, b in zip(events[:-1], events[1:])]
    return times[0], times[1:]


def _cuda_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise DeviceError(f"the torch.compile baseline runs on a CUDA device, not {device}")
    if not torch.cuda.is_available():
        raise DeviceError("the torch.compile baseline needs a CUDA GPU, and torch sees none "
                          f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    return device
