"""Small shared builders for tests: a tiny random LLaMA with the byte-level fallback tokenizer."""

from __future__ import annotations

import torch

from model_zoo.config import LlamaConfig
from model_zoo.reference import ReferenceModel
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import ModelWeights, random_state_dict

TINY = LlamaConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0, max_positions=256, name="tiny")


def tiny_model(seed: int = 0, config: LlamaConfig = TINY) -> ReferenceModel:
    return ReferenceModel(ModelWeights.from_state_dict(config, random_state_dict(config, seed=seed)))


def byte_tokenizer(vocab: int = TINY.vocab_size) -> Tokenizer:
    return Tokenizer.byte_fallback(vocab)


class EosTokenizer:
    """Wraps a tokenizer to end generation on chosen ids."""

    def __init__(self, tok: Tokenizer, eos_ids: set[int]):
        self._tok, self.eos_ids = tok, frozenset(eos_ids)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
