"""Random weights: seeded weights in the shape of a preset (or of a checkpoint's config)."""

from __future__ import annotations

import torch

from model_zoo.config import LlamaConfig
from model_zoo.loaders.loaded_model import LoadedModel
from model_zoo.loaders.tensors import cut_config
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import random_state_dict


def load_random(config: LlamaConfig, *, source: str, seed: int, dtype: torch.dtype, n_layers: int | None = None,
                tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Random weights; without a tokenizer, the byte-level fallback sized to the config's vocabulary."""
    config = cut_config(config, n_layers)
    sd = random_state_dict(config, seed=seed, dtype=dtype)  # [V, H] embeddings, [N, K] linears
    tok = tokenizer or Tokenizer.byte_fallback(config.vocab_size)
    meta = {"quantization_config": None, "fllama": None, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
            "tokenizer": "byte_fallback" if tokenizer is None else "model"}
    return LoadedModel(config=config, tokenizer=tok, state_dict=sd, source=source, kind="random", meta=meta)
