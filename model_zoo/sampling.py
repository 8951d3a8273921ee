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


def row_seed(seed: int, row: int) -> int:
    """The seed of row `row` of a batch seeded `seed`. Row 0 keeps the seed, so a seeded request draws the same
    tokens alone, as row 0 of a batch, or in any server slot configured with it (configure_row)."""
    return (seed + row * 0x9E3779B97F4A7C15) & 0x7FFF_FFFF_FFFF_FFFF


class TorchSampler:
    """Per-row sampling state: each row's SamplingConfig, its seen-token mask (the repetition penalty) and its own
    generator, so a row draws the same tokens whatever the other rows of the batch do."""

    def __init__(self, cfg: SamplingConfig, batch: int, vocab: int, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.configs = [cfg] * batch
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # [B, V]
        seed = cfg.seed if cfg.seed is not None else fresh_seed()
        self.generators = [self._generator(row_seed(seed, b)) for b in range(batch)]

    def _generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.seen.device)
        g.manual_seed(seed)
        return g

    def configure_row(self, row: int, cfg: SamplingConfig) -> None:
        """A new sequence in `row`: its own config and seed (a fresh one when cfg.seed is None), nothing seen."""
        self.configs[row] = cfg
        self.seen[row] = False
        self.generators[row] = self._generator(cfg.seed if cfg.seed is not None else fresh_seed())

    def observe(self, row: int, tokens: list[int]) -> None:
        """Mark prompt tokens as seen (the penalty covers the prompt, as in transformers)."""
        if tokens:
            self.seen[row, torch.tensor(tokens, device=self.seen.device)] = True

    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [b, V] for the given rows of the batch -> tokens [b] (int64); records them as seen."""
        idx = torch.tensor(rows, device=self.seen.device)
        logits = logits.float()
        cfgs = [self.configs[r] for r in rows]
        if any(c.repetition_penalty != 1.0 for c in cfgs):
            logits = torch.cat([apply_repetition_penalty(logits[i:i + 1], self.seen[r:r + 1], c.repetition_penalty)
                                for i, (r, c) in enumerate(zip(rows, cfgs))])  # [b, V]
        tokens = logits.argmax(-1)  # [b]: the greedy rows' answer
        for i, (r, c) in enumerate(zip(rows, cfgs)):
            if not c.greedy:
                row = filter_top_k_top_p(logits[i:i + 1] / c.temperature, c.top_k, c.top_p)  # [1, V]
                tokens[i] = torch.multinomial(row.softmax(-1), 1, generator=self.generators[r])[0, 0]
        self.seen[idx, tokens.to(self.seen.device)] = True
        return tokens
