"""CUDA graphs and stream order for the engine: every public call ordered with the caller's stream, decode steps
captured once per bucket, and short prefills captured the second time their shape comes."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Callable

import torch

from kernels_cu import build, tuning
from kernels_cu.engine.cache import GpuCache
from model_zoo.errors import DeviceError

PREFILL_SEEN_MAX = 256  # prefill shapes remembered as seen once; the set restarts when full


@contextmanager
def caller_ordered():
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


def api(fn: Callable) -> Callable:
    """For the public methods of an object with a `tuning`: ordered with the caller's stream, its Tuning in force."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        # no_grad, not inference_mode: the caches and buffers must stay ordinary tensors that callers (the
        # chat session's cache.lengths) may update in place outside any mode. Programmatic launch: the
        # weights were written and synchronized at construction, so kernels may prefetch them early.
        with torch.no_grad(), caller_ordered(), build.programmatic(), tuning.active(self.tuning):
            return fn(self, *args, **kwargs)
    return wrapper


def record(body: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """body's kernels and torch ops captured on fllama's stream (the one every launch checks): (graph, its output).
    What body launches must already be built and warmed up; the capture itself runs nothing."""
    build.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=build.torch_stream()):
        out = body()
    return graph, out


class PrefillGraphs:
    """Which prefills replay a graph: a shape (rows, length, starts) of at most `max_tokens` tokens that comes a
    second time is captured, and replayed from then on; the `keep` most recently used graphs are kept per cache
    (each holds its own activation memory). A shape seen once runs eagerly: most never come again (chat turns)."""

    def __init__(self, max_tokens: int, keep: int):
        self.max_tokens, self.keep = max_tokens, keep
        self.failed = False  # an op could not be captured: this engine's prefills stay eager

    def run(self, cache: GpuCache, key: tuple, tokens: torch.Tensor, eager: Callable[[], torch.Tensor],
            capture: Callable[[], tuple]) -> torch.Tensor:
        """The prefill's logits: eager(), or the replay of capture()'s (graph, ids input, logits, other inputs)."""
        if self.failed or tokens.numel() > self.max_tokens:
            return eager()
        graphs = cache.prefill_graphs
        entry = graphs.get(key)
        if entry is None:
            if key not in cache.prefill_seen:
                if len(cache.prefill_seen) >= PREFILL_SEEN_MAX:
                    cache.prefill_seen.clear()
                cache.prefill_seen.add(key)
                return eager()
            try:
                entry = graphs[key] = capture()
            except (DeviceError, RuntimeError):
                if os.environ.get("FLLAMA_DEBUG") == "1":
                    raise
                self.failed = True  # capturing ran nothing: the cache is as it was
                return eager()
            while len(graphs) > self.keep:
                graphs.popitem(last=False)  # the least recently used
        graphs.move_to_end(key)
        graph, ids, out, _ = entry
        with build.on_stream():
            ids.copy_(tokens.reshape(-1))  # [T] int32 on the GPU: the graph's one input that changes
            graph.replay()
            return out.clone()  # the graph's output is overwritten by its next replay
