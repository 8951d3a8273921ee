"""A multi-turn conversation whose KV cache is kept between turns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_zoo.chat_template import default_template, render_chat
from model_zoo.errors import ConfigError, PromptError
from model_zoo.generation import GenerationConfig, GenerationStats, TextCallback, generate
from model_zoo.warm_up import warm_up

DEFAULT_CONTEXT = 4096  # KV-cache positions when none is asked for (capped at the model's context)


@dataclass
class ChatReply:
    text: str
    stats: GenerationStats
    finish_reason: str  # "eos" | "stop" | "length"
    dropped_turns: int = 0  # oldest exchanges dropped so that this turn fits the context
    context_full: bool = False  # the reply stopped because the context had no room left


class ChatSession:
    """Renders the conversation with the model's template and prefills only what the cache lacks.

    A conversation longer than the context loses its oldest exchanges (the system prompt stays); a turn that
    fails or is interrupted leaves the session usable."""

    def __init__(self, backend: Any, tokenizer: Any, cfg: GenerationConfig, system: str | None = None,
                 max_len: int | None = None):
        self.backend, self.tokenizer, self.cfg, self.system = backend, tokenizer, cfg, system
        self.template = tokenizer.chat_template or default_template(tokenizer)
        limit = backend.config.max_positions
        self.max_len = min(DEFAULT_CONTEXT, limit) if max_len is None else max_len
        if self.max_len > limit:
            raise ConfigError(f"--context {self.max_len} is beyond the model's context of {limit} tokens")
        floor = len(self._render([*self._start(), {"role": "user", "content": ""}])) + 1
        if self.max_len < floor:  # --context 0 included
            raise ConfigError(f"--context {self.max_len} cannot hold the chat template and system prompt with an "
                              f"empty message and a one-token reply ({floor} tokens)")
        self.cache = backend.new_cache(1, self.max_len)
        self.reset()

    def warm_up(self) -> float:
        """Before the first turn, a short run on this session's cache (model_zoo.warm_up): kernels loaded and the
        decode graph captured, so the first reply's rate is its own. Seconds taken (0: a backend without graphs)."""
        ids = self._render([*self.messages, {"role": "user", "content": ""}])  # a first turn's shape
        return warm_up(self.backend, self.tokenizer, [ids], self.cfg, cache=self.cache)

    def _start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def reset(self) -> None:
        self.messages: list[dict] = self._start()
        self.cached_ids: list[int] = []  # the tokens whose K/V sit in the cache, in order
        self.cache.lengths.zero_()

    def prompt_ids(self) -> list[int]:
        return self._render(self.messages)

    def _render(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        text = render_chat(self.template, messages, add_generation_prompt=True,
                           bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        return tok.encode(text, add_special_tokens=False)  # the template writes its own special tokens

    def send(self, user_text: str, on_text: TextCallback | None = None) -> ChatReply:
        self.messages.append({"role": "user", "content": user_text})
        try:
            ids, dropped = self._fit()
        except BaseException:
            self.messages.pop()
            raise
        keep = min(_common_prefix(self.cached_ids, ids), len(ids) - 1)  # >= 1 new token feeds the first logits
        self.cache.lengths[0] = keep  # positions past `keep` are overwritten by this turn
        self.cached_ids = self.cached_ids[:keep]
        shown: list[str] = []

        def stream(row: int, text: str) -> None:
            shown.append(text)
            if on_text:
                on_text(row, text)

        try:
            results, stats = generate(self.backend, self.tokenizer, [ids[keep:]], self.cfg, on_text=stream,
                                      cache=self.cache, rows=[0])
        except KeyboardInterrupt:  # the reply so far stays in the conversation; the cache keeps what it knew
            if self.cache.lengths.is_cuda:  # a GPU step may still be writing the lengths: let it finish first
                torch.cuda.synchronize(self.cache.lengths.device)
            self.cache.lengths[0] = keep
            self.messages.append({"role": "assistant", "content": "".join(shown)})
            raise
        except BaseException:
            self.cache.lengths[0] = keep
            self.messages.pop()
            raise
        reply = results[0]
        self.cached_ids = (ids + reply.tokens)[:int(self.cache.lengths[0])]
        self.messages.append({"role": "assistant", "content": reply.text})
        full = reply.finish_reason == "length" and len(reply.tokens) < self.cfg.max_new_tokens
        return ChatReply(reply.text, stats, reply.finish_reason, dropped, full)

    def _fit(self) -> tuple[list[int], int]:
        """The prompt ids, after dropping the oldest exchanges until the prompt leaves room for a reply (up to
        max_new_tokens, at most half the context); PromptError, with the conversation as it was, if the newest
        message alone does not fit."""
        room = min(self.cfg.max_new_tokens, self.max_len // 2)
        first = 1 if self.system else 0  # the system prompt is never dropped
        messages, dropped = list(self.messages), 0
        ids = self._render(messages)
        while len(ids) + room > self.max_len and len(messages) - first > 1:
            del messages[first:first + 2]  # one exchange: a user message and the reply to it
            dropped += 1
            ids = self._render(messages)
        if len(ids) >= self.max_len:
            raise PromptError(f"this message makes a prompt of {len(ids)} tokens but the chat context holds "
                              f"{self.max_len}: shorten it (or raise --context)")
        self.messages = messages
        return ids, dropped


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
