"""The generation loop, for any Backend: ragged prefill, batched decode, sampling, stops, streaming."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from model_zoo.backend import Backend, check_token_ids, make_sampler
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, PromptError
from model_zoo.sampling import SamplingConfig

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


class _Row:
    """Per-row decoding state: tokens, streamed text and stop detection."""

    def __init__(self, index: int, prompt_len: int, tokenizer: Any, cfg: GenerationConfig):
        self.index, self.prompt_len, self.cfg = index, prompt_len, cfg
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.decoder = tokenizer.stream_decoder()
        self.eos_ids = tokenizer.eos_ids if cfg.stop_at_eos else frozenset()
        self.emitted = 0  # characters of self.text already handed to the callback

    def push(self, token: int, budget: int, on_text: TextCallback | None) -> None:
        if token in self.eos_ids:
            self.finish_reason = "eos"
            self._emit(self.text + self.decoder.flush(), on_text, final=True)
            return
        self.tokens.append(token)
        text = self.text + self.decoder.push(token)
        for stop in self.cfg.stop_strings:
            cut = text.find(stop)
            if cut >= 0:
                self.finish_reason = "stop"
                self._emit(text[:cut], on_text, final=True)
                return
        if len(self.tokens) >= budget:
            self.finish_reason = "length"
            self._emit(text + self.decoder.flush(), on_text, final=True)
            return
        self._emit(text, on_text, final=False)

    def _emit(self, text: str, on_text: TextCallback | None, final: bool) -> None:
        self.text = text
        # hold back a tail that could be the start of a stop string, so it is never printed then cut
        hold = 0 if final else max((len(s) - 1 for s in self.cfg.stop_strings), default=0)
        ready = len(text) - hold
        if on_text and ready > self.emitted:
            on_text(self.index, text[self.emitted:ready])
            self.emitted = ready


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


def generate(backend: Backend, tokenizer: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig,
             on_text: TextCallback | None = None, cache: Any = None,
             rows: Sequence[int] | None = None) -> tuple[list[RowResult], GenerationStats]:
    """Prefill each prompt into its cache row (ragged), then decode the batch together.

    With `cache`, prompts continue the given cache rows (chat turns); otherwise a cache sized for the
    longest prompt plus max_new_tokens (capped at the context) is made. Each row yields the same greedy
    tokens as when run alone: rows never see each other.
    """
    config = backend.config
    check_prompts(prompts, config)
    B = len(prompts)
    row_ids = list(range(B)) if rows is None else list(rows)
    if cache is None:
        max_len = min(config.max_positions, max(len(p) for p in prompts) + cfg.max_new_tokens)
        cache = backend.new_cache(B, max_len)
    start = [int(cache.lengths[r]) for r in row_ids]
    budgets = [min(cfg.max_new_tokens, cache.max_len - s - len(p)) for s, p in zip(start, prompts)]
    for (s, p) in zip(start, prompts):
        if s + len(p) >= cache.max_len:
            raise PromptError(f"the conversation has {s + len(p)} tokens but the context holds {cache.max_len}: "
                              "start a new one (/reset)")
    sampler = make_sampler(backend, cfg.sampling, B)
    states = [_Row(i, len(p), tokenizer, cfg) for i, p in enumerate(prompts)]
    device = backend.device

    t0 = time.perf_counter()
    first_logits = []
    for i, (r, p) in enumerate(zip(row_ids, prompts)):
        sampler.observe(i, list(p))
        logits = backend.forward(torch.tensor([list(p)], device=device), cache, torch.tensor([r], device=device))
        first_logits.append(logits[:, -1])  # [1, V]
    tokens_host = sampler.sample(torch.cat(first_logits), list(range(B))).tolist()
    t1 = time.perf_counter()
    for st, tok, budget in zip(states, tokens_host, budgets):
        st.push(tok, budget, on_text)

    fused = getattr(backend, "decode_sampled", None)
    while True:
        live = [st for st in states if st.finish_reason is None]
        if not live:
            break
        idx = [st.index for st in live]
        active = torch.tensor([row_ids[i] for i in idx], device=device)  # cache rows still decoding
        last = torch.tensor([[st.tokens[-1]] for st in live], device=device)  # [b, 1]
        if fused is not None:  # the backend decodes and samples in one step (the GPU engine's graph)
            next_tokens = fused(last[:, 0], cache, active.tolist(), sampler)
        else:
            next_tokens = sampler.sample(backend.forward(last, cache, active)[:, -1], idx)  # from logits [b, V]
        for st, tok in zip(live, next_tokens.tolist()):
            st.push(tok, budgets[st.index], on_text)
    t2 = time.perf_counter()

    results = [RowResult(st.tokens, st.text, st.prompt_len, st.finish_reason or "length") for st in states]
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts),
                            generated_tokens=sum(len(st.tokens) + (st.finish_reason == "eos") for st in states),
                            prefill_s=t1 - t0, decode_s=t2 - t1)
    return results, stats
