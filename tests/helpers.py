"""Small shared builders for tests: a tiny random LLaMA with the byte-level fallback tokenizer."""

from __future__ import annotations

from pathlib import Path

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


def tiny_hf_dir(tmp_path_factory, config: LlamaConfig) -> Path:
    """A transformers-style checkpoint directory of `config` with random weights (module-scoped fixtures)."""
    from tests._fixtures_loaders import write_hf_dir

    d = tmp_path_factory.mktemp("tiny")
    write_hf_dir(d, config)
    return d


def calib_text_file(tmp_path_factory) -> Path:
    """20,000 characters of Sherlock Holmes in a .txt file: calibration text that needs no hub."""
    from model_zoo.text_sources import load_text

    p = tmp_path_factory.mktemp("text") / "calib.txt"
    p.write_text(load_text("gutenberg:sherlock")[:20000])
    return p
