"""Token sampling in torch: greedy, temperature, top-k, top-p, repetition penalty (CPU or CUDA tensors)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from model_zoo.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.7  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    repetition_penalty: float = 1.0  # HF rule: >1 discourages tokens already in the row
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:  # nan would pass a plain `< 0`
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigError(f"repetition penalty must be a finite number > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool. Positive logits are divided by the penalty, negative multiplied."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the smallest set with mass >= top_p to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def fresh_seed() -> int:
    """A random 63-bit seed. (torch.seed() also reseeds every CUDA generator, and its 64-bit value overflows
    there about half the time.)"""
    return secrets.randbits(63)


class TorchSampler:
    """Per-batch sampling state: the seen-token mask for the repetition penalty and the generator."""

    def __init__(self, cfg: SamplingConfig, batch: int, vocab: int, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # [B, V]
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed if cfg.seed is not None else fresh_seed())

    def observe(self, row: int, tokens: list[int]) -> None:
        """Mark prompt tokens as seen (the penalty covers the prompt, as in transformers)."""
        if tokens:
            self.seen[row, torch.tensor(tokens, device=self.seen.device)] = True

    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [b, V] for the given rows of the batch -> tokens [b] (int64); records them as seen."""
        cfg = self.cfg
        idx = torch.tensor(rows, device=self.seen.device)
        logits = apply_repetition_penalty(logits.float(), self.seen[idx], cfg.repetition_penalty)
        if cfg.greedy:
            tokens = logits.argmax(-1)
        else:
            logits = filter_top_k_top_p(logits / cfg.temperature, cfg.top_k, cfg.top_p)
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=self.generator)[:, 0]
        self.seen[idx, tokens.to(self.seen.device)] = True
        return tokens
