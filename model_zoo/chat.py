"""A multi-turn conversation whose KV cache is kept between turns."""

from __future__ import annotations

from typing import Any

from model_zoo.chat_template import default_template, render_chat
from model_zoo.generation import GenerationConfig, GenerationStats, TextCallback, generate


class ChatSession:
    """Renders the conversation with the model's template and prefills only what the cache lacks."""

    def __init__(self, backend: Any, tokenizer: Any, cfg: GenerationConfig, system: str | None = None,
                 max_len: int | None = None):
        self.backend, self.tokenizer, self.cfg, self.system = backend, tokenizer, cfg, system
        self.template = tokenizer.chat_template or default_template(tokenizer)
        self.max_len = min(max_len or 4096, backend.config.max_positions)
        self.cache = backend.new_cache(1, self.max_len)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cached_ids: list[int] = []  # the tokens whose K/V sit in the cache, in order
        self.cache.lengths.zero_()

    def prompt_ids(self) -> list[int]:
        tok = self.tokenizer
        text = render_chat(self.template, self.messages, add_generation_prompt=True,
                           bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        return tok.encode(text, add_special_tokens=False)  # the template writes its own special tokens

    def send(self, user_text: str, on_text: TextCallback | None = None) -> tuple[str, GenerationStats]:
        self.messages.append({"role": "user", "content": user_text})
        ids = self.prompt_ids()
        keep = _common_prefix(self.cached_ids, ids)
        keep = min(keep, len(ids) - 1)  # at least one new token feeds the first logits
        self.cache.lengths[0] = keep  # positions past `keep` are overwritten by this turn
        results, stats = generate(self.backend, self.tokenizer, [ids[keep:]], self.cfg, on_text=on_text,
                                  cache=self.cache, rows=[0])
        reply = results[0]
        self.cached_ids = (ids + reply.tokens)[:int(self.cache.lengths[0])]
        self.messages.append({"role": "assistant", "content": reply.text})
        return reply.text, stats


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
