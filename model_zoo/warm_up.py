"""A short run of a request before the request itself, on backends that capture graphs (the GPU engine).

The first generate() of a process loads the kernels its prefill and decode use and captures the decode step's
graph for its batch. Counted in that call, it makes the first request's time to first token and decode rate (what
`fllama generate` and `chat` report) a measure of setup: Llama-3.2-1B awq's first 64 tokens on an H200 decode at
1,119 tok/s against the engine's 2,420. warm_up() pays it up front (0.16 s there), with the request's own batch,
cache size and sampling.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from model_zoo.generation import GenerationConfig, cache_positions, generate

WARM_PROMPT = 256  # prompt tokens a warm-up prefills at most (a bound on its cost for long prompts)


def warm_up(backend: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
            cache: Any = None, max_prompt: int = WARM_PROMPT) -> float:
    """Run generate() on shortened copies of `prompts` (2 new tokens) so that the real call finds its kernels
    loaded and its decode graph captured; nothing on backends without a pipe of their own (CPU). Each copy is
    shorter than its prompt, since a prefill shape seen twice is captured on the second sighting (the real call).
    `cache`: the caller's (a chat session's), whose lengths are put back; without it, the cache generate() will
    make for `prompts` (same rows and size: the engine keeps it, and its graph, for the real call).
    `max_prompt`: the copies' length at most. Returns the seconds it took."""
    if getattr(backend, "decode_pipe", None) is None:
        return 0.0
    t0 = time.perf_counter()
    short = [list(p[:max(1, min(len(p) - 1, max_prompt))]) for p in prompts]
    if cache is None:
        cache, saved = backend.new_cache(len(prompts), cache_positions(backend.config, prompts, cfg)), None
    else:
        saved = cache.lengths.clone()
    try:
        short_cfg = dataclasses.replace(cfg, max_new_tokens=2, stop_strings=(), stop_at_eos=False)
        generate(backend, tokenizer, short, short_cfg, cache=cache)
    finally:
        if saved is not None:
            cache.lengths.copy_(saved)
        else:
            cache.lengths.zero_()
    return time.perf_counter() - t0
