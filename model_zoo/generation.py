"""The generation loop, for any Backend: ragged prefill, batched decode, sampling, stops, streaming."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from model_zoo.backend import Backend, check_token_ids, make_sampler
from model_zoo.config import LlamaConfig
from model_zoo.decode_pipe import DecodePipe, open_pipe
from model_zoo.errors import ConfigError, PromptError
from model_zoo.sampling import SamplingConfig
from model_zoo.text_stream import OnText, TextStream

# on_text(row, text): called with each complete piece of text as it is generated
TextCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ConfigError("a stop string is empty: it would end every reply before its first token")


@dataclass
class RowResult:
    tokens: list[int]  # generated ids only (a stop string's tokens included, its text cut)
    text: str
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop" | "length"


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the time after the first token (decode throughput)."""
        decode_tokens = max(self.generated_tokens - 1, 0)
        return decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


def check_prompts(prompts: Sequence[Sequence[int]], config: LlamaConfig) -> None:
    """PromptError unless every prompt is non-empty, leaves room for a token in the context, and holds only
    ids of the model's vocabulary."""
    if not prompts:
        raise PromptError("no prompt given")
    for i, p in enumerate(prompts):
        which = f" (prompt {i + 1})" if len(prompts) > 1 else ""
        if len(p) == 0:
            raise PromptError("the prompt is empty" + which)
        if len(p) >= config.max_positions:
            raise PromptError(f"the prompt{which} has {len(p)} tokens but the model's context is "
                              f"{config.max_positions}: shorten it")
        check_token_ids(torch.as_tensor(list(p), dtype=torch.long), config.vocab_size, "the prompt" + which)


def cache_positions(config: LlamaConfig, prompts: Sequence[Sequence[int]], cfg: GenerationConfig) -> int:
    """Positions of the cache generate() makes for `prompts`: the longest plus max_new_tokens, within the context."""
    return min(config.max_positions, max(len(p) for p in prompts) + cfg.max_new_tokens)


def generate(backend: Backend, tokenizer: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
             on_text: TextCallback | None = None, cache: Any = None,
             rows: Sequence[int] | None = None) -> tuple[list[RowResult], GenerationStats]:
    """Prefill each prompt into its cache row (ragged), then decode the batch together.

    With `cache`, prompts continue the given cache rows (chat turns); otherwise a cache sized for the
    longest prompt plus max_new_tokens (capped at the context) is made. Each row yields the same greedy
    tokens as when run alone: rows never see each other. Decode steps run ahead of the host (decode_pipe.py);
    afterwards each row's cache length counts exactly the tokens it was fed.
    """
    config = backend.config
    check_prompts(prompts, config)
    B = len(prompts)
    row_ids = list(range(B)) if rows is None else list(rows)
    if cache is None:
        max_len = cache_positions(config, prompts, cfg)
        cache = backend.new_cache(B, max_len)
    start = [int(cache.lengths[r]) + len(p) for r, p in zip(row_ids, prompts)]  # lengths after the prefill
    for s in start:
        if s >= cache.max_len:
            raise PromptError(f"the conversation has {s} tokens but the context holds {cache.max_len}: "
                              "start a new one (/reset)")
    budgets = [min(cfg.max_new_tokens, cache.max_len - s) for s in start]
    sampler = make_sampler(backend, cfg.sampling, cache.lengths.shape[0])  # its rows are the cache's rows
    streams = [TextStream(tokenizer, budget, cfg.stop_strings, cfg.stop_at_eos, _row_callback(on_text, i))
               for i, budget in enumerate(budgets)]

    t0 = time.perf_counter()
    first = _prefill(backend, cache, sampler, row_ids, prompts)
    t1 = time.perf_counter()
    for ts, tok in zip(streams, first):
        ts.push(tok)
    _decode(open_pipe(backend, cache, sampler), streams, row_ids, start, first)
    t2 = time.perf_counter()

    results = [RowResult(ts.tokens, ts.text, len(p), ts.finish_reason or "length") for ts, p in zip(streams, prompts)]
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts),
                            generated_tokens=sum(ts.generated for ts in streams), prefill_s=t1 - t0, decode_s=t2 - t1)
    return results, stats


def _row_callback(on_text: TextCallback | None, row: int) -> OnText | None:
    return None if on_text is None else (lambda text: on_text(row, text))


def _prefill(backend: Backend, cache: Any, sampler: Any, rows: list[int],
             prompts: Sequence[Sequence[int]]) -> list[int]:
    """Each prompt into its cache row; the first token of each row."""
    device = backend.device
    first_logits = []
    for r, p in zip(rows, prompts):
        sampler.observe(r, list(p))
        logits = backend.forward(torch.tensor([list(p)], device=device), cache, torch.tensor([r], device=device),
                                 last=True)  # [1, 1, V]
        first_logits.append(logits[:, -1])  # [1, V]
    return sampler.sample(torch.cat(first_logits), rows).tolist()


def _decode(pipe: DecodePipe, streams: list[TextStream], rows: list[int], start: list[int],
            first: list[int]) -> None:
    """Decode until every row is done, `pipe.depth` steps in flight. A row leaves the pipe once the step that
    samples its last allowed token is launched, or when its end (EOS, a stop string) is read; tokens of steps
    that ran past a row's end are dropped, and its cache length is set back to what it was fed."""
    by_row = dict(zip(rows, streams))
    pushed = {r: 1 for r in rows}  # tokens each row has taken (the prefill's first)
    launched = {r: 0 for r in rows}
    for r, s, ts, tok in zip(rows, start, streams, first):
        if not ts.done:
            pipe.join(r, tok, s)
    inflight: deque = deque()
    while True:
        while len(inflight) < pipe.depth and pipe.rows:
            step = pipe.launch()
            inflight.append(step)
            for r in step.rows:
                launched[r] += 1
                if launched[r] >= by_row[r].budget - 1:  # the step sampling its last allowed token is on its way
                    pipe.leave(r)
        if not inflight:
            break
        step = inflight.popleft()
        for r, tok in zip(step.rows, step.tokens()):
            ts = by_row[r]
            if ts.done:
                continue  # a step launched before the row's end was read
            pushed[r] += 1
            if ts.push(tok):
                pipe.leave(r)
    for r, s in zip(rows, start):
        if launched[r] != pushed[r] - 1:  # steps ran past the row's end: its length is what it was fed
            pipe.set_length(r, s + pushed[r] - 1)  # every token taken but the last
