"""Measurements behind `fllama bench`: copy bandwidth, the engine's prefill and decode, the bandwidth floor.

Every figure is taken in the same process on the same GPU, with CUDA events after warm-up; the decode step
is the captured graph (decode + GPU sampling), replayed with no host work in between.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.linear import DenseLinear
from model_zoo.sampling import SamplingConfig
from model_zoo.weights import LINEAR_NAMES, LayerWeights, ModelWeights

SCHEMES = ("fp16", "int8", "awq", "fp8")


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    gen_len: int = 128
    repeat: int = 3
    group_size: int = 128
    # the engine's decode and generation loop sample with this (greedy by default; the baseline stays greedy)
    sampling: SamplingConfig = SamplingConfig(temperature=0)

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or max(self.batches) > 64:
            raise ConfigError("batch sizes must be between 1 and 64")
        if self.prompt_len < 1 or self.gen_len < 2 or self.repeat < 1:
            raise ConfigError("prompt-len >= 1, gen-len >= 2 and repeat >= 1 are needed")


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling decode is compared with)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def random_weights(config: LlamaConfig, scheme: str, device: torch.device, seed: int = 0,
                   group_size: int = 128) -> ModelWeights:
    """Random weights of `config`'s shapes, made and quantized on the GPU one layer at a time (a 70B model's
    fp16 weights never exist at once). int8 / fp8: per-channel weights, per-token activations; awq: RTN groups."""
    from model_zoo.quant.linear import ActQuant, AwqLinear, Fp8Linear, Int8Linear

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; schemes: {', '.join(SCHEMES)}")
    g = torch.Generator(device=device).manual_seed(seed)
    c, h = config, config.hidden_size

    def rnd(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g, device=device, dtype=torch.float16) * (1 / math.sqrt(k))

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g, device=device)).half()

    shapes = {"wq": (c.q_size, h), "wk": (c.kv_size, h), "wv": (c.kv_size, h), "wo": (h, c.q_size),
              "w_gate": (c.ffn_size, h), "w_up": (c.ffn_size, h), "w_down": (h, c.ffn_size)}
    layers = []
    for _ in range(c.n_layers):
        lin = {}
        for attr, _path in LINEAR_NAMES:
            w = rnd(*shapes[attr])
            if scheme == "int8":
                lin[attr] = Int8Linear.from_dense(w.float(), ActQuant.DYNAMIC, scale_dtype=torch.float16)
            elif scheme == "awq":
                lin[attr] = AwqLinear.from_dense(w.float(), group_size)
            elif scheme == "fp8":
                lin[attr] = Fp8Linear.from_dense(w.float(), ActQuant.DYNAMIC)
            else:
                lin[attr] = DenseLinear(w)
            del w
        layers.append(LayerWeights(attn_norm=norm(), ffn_norm=norm(), **lin))
    embed = torch.randn(c.vocab_size, h, generator=g, device=device, dtype=torch.float16) * 0.5
    lm_head = embed if c.tie_embeddings else rnd(c.vocab_size, h)
    return ModelWeights(config=c, embed=embed, layers=layers, norm=norm(), lm_head=lm_head, meta={"scheme": scheme})


def decode_bytes(engine, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads at an average context of `context` positions."""
    kv = batch * context * engine.kv_position_bytes()  # 8-bit codes and their scales with --kv-int8 / --kv-fp8
    return engine.step_weight_bytes(batch), kv  # the lm_head as it runs (fp16 or int8), B embedding rows


def events_time(fn, repeat: int) -> list[float]:
    """Seconds of each of `repeat` calls of fn, by CUDA events on the current stream."""
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def bench_engine(engine, batch: int, cfg: BenchConfig, bandwidth: float, seed: int = 0) -> dict:
    """Prefill, time to first token and graph-replayed decode of one batch size on one engine."""
    from kernels_cu import build

    c = engine.config
    max_len = cfg.prompt_len + cfg.gen_len + 1
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, c.vocab_size, (batch, cfg.prompt_len), generator=g)  # [B, P]
    torch.cuda.reset_peak_memory_stats(engine.device)
    sampler = engine.make_sampler(cfg.sampling, batch)
    cache = engine.new_cache(batch, max_len)
    stream = build.torch_stream()
    rows = list(range(batch))

    def prefill(graph: bool = True) -> None:
        cache.lengths.zero_()
        logits = engine.forward(prompts, cache, prefill_graph=graph, last=True)  # [B, 1, V], as generation asks
        sampler.sample(logits[:, -1], rows)

    # warm-up: kernel builds, cuBLAS heuristics and handles, allocator pools (one was noisy); a short prefill's
    # graph is captured on its shape's second run (tuning.prefill_graph_tokens), as torch.compile's is per shape
    for _ in range(3):
        prefill()
    with torch.cuda.stream(stream):
        prefill_times = events_time(prefill, cfg.repeat)
        eager_times = events_time(lambda: prefill(graph=False), cfg.repeat)  # a prompt of a new shape
    prefill_s = statistics.median(prefill_times)

    # decode: the first step captures the graph; then time each replay separately
    first = torch.zeros(batch, dtype=torch.long)
    step_times: list[float] = []
    for _ in range(cfg.repeat):
        cache.lengths.fill_(cfg.prompt_len)
        engine.decode_sampled(first, cache, rows, sampler)  # warm-up / capture, then feeds itself on device
        with torch.cuda.stream(stream):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.gen_len)]
            for i in range(cfg.gen_len - 1):
                events[i].record()
                engine.replay_steps(cache, 1)
            events[-1].record()
            events[-1].synchronize()
        step_times += [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(cfg.gen_len - 1)]
    step_times.sort()
    med = statistics.median(step_times)
    p90 = step_times[min(len(step_times) - 1, int(0.9 * len(step_times)))]
    w_bytes, kv_bytes = decode_bytes(engine, batch, cfg.prompt_len + cfg.gen_len // 2)
    # floor: the step's bytes over the measured copy rate (bytes read + written per second), the memory
    # system's throughput; REFERENCE.md section 5 computes its floors the same way
    floor_s = (w_bytes + kv_bytes) / bandwidth
    return {"batch": batch, "prefill_tok_s": batch * cfg.prompt_len / prefill_s, "ttft_ms": prefill_s * 1e3,
            "ttft_eager_ms": statistics.median(eager_times) * 1e3,
            "decode_tok_s": batch / med, "ms_per_step_median": med * 1e3, "ms_per_step_p90": p90 * 1e3,
            "bytes_per_step": w_bytes + kv_bytes, "effective_gb_s": (w_bytes + kv_bytes) / med / 1e9,
            "pct_of_bandwidth": 100 * (w_bytes + kv_bytes) / med / bandwidth,
            "floor_ms": floor_s * 1e3, "floor_tok_s": batch / floor_s,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(engine.device)}


def bench_baseline(weights: ModelWeights, batch: int, cfg: BenchConfig) -> dict:
    """The reference model in fp16 under torch.compile (CUDA graphs), same shapes (kernels_cu/torch_baseline.py)."""
    from kernels_cu.torch_baseline import time_baseline

    t0 = time.perf_counter()
    r = time_baseline(weights, batch, cfg.prompt_len, cfg.gen_len, cfg.repeat, weights.device)
    r["wall_s"] = time.perf_counter() - t0
    return r
