"""What a generation backend provides: the CPU/torch reference and the GPU engine both implement it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import PromptError
from model_zoo.sampling import SamplingConfig, TorchSampler


class Backend(Protocol):
    """Optional extras a backend may add (the GPU engine does): make_sampler(cfg, batch) for its own sampler, and
    decode_sampled(tokens [b], cache, rows, sampler) -> next tokens [b], one step decoded and sampled together."""

    name: str
    config: LlamaConfig

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch: int, max_len: int) -> Any:
        """A KV cache for `batch` rows of up to `max_len` positions each; every row starts empty."""
        ...

    def forward(self, tokens: torch.Tensor, cache: Any = None, rows: torch.Tensor | None = None, *,
                last: bool = False) -> torch.Tensor:
        """tokens [B, S] -> fp32 logits [B, S, V]; with a cache, row r continues at its cached length. last: only
        each row's last position, [B, 1, V] (a prompt's prefill needs no more; evaluation needs every position)."""
        ...


def make_sampler(backend: Backend, cfg: SamplingConfig, batch: int) -> Any:
    """The backend's own sampler when it has one (GPU sampling), the torch sampler otherwise."""
    factory = getattr(backend, "make_sampler", None)
    if factory is not None:
        return factory(cfg, batch)
    return TorchSampler(cfg, batch, backend.config.vocab_size, backend.device)


def check_token_ids(tokens: torch.Tensor, vocab_size: int, what: str = "the input") -> None:
    """Every id in [0, vocab_size), else PromptError: an embedding lookup would fail (id >= V) or silently take
    another row (id < 0 wraps to the end)."""
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        hint = " (is the tokenizer the model's own?)" if bad >= vocab_size else ""
        raise PromptError(f"{what} has token id {bad}, outside the model's vocabulary of {vocab_size} "
                          f"(ids 0..{vocab_size - 1}){hint}")
