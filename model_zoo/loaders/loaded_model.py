"""LoadedModel: what every loader returns (re-exported as model_zoo.load.LoadedModel)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_zoo.config import LlamaConfig
from model_zoo.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: LlamaConfig
    tokenizer: Tokenizer
    # HF names. Float tensors in the requested dtype; integer tensors (qweight, qzeros, int8 weight) and
    # quantization scales (weight_scale, scales, input_scale) as stored.
    state_dict: dict[str, torch.Tensor]
    source: str  # what the user gave, resolved: a path, a hub id or a preset name
    kind: str  # "hf-dir" | "hub" | "gguf" | "named" | "random"
    # quantization_config (config.json or None), fllama (fllama_meta.json or None), dtype (of stored weights),
    # gguf_file_type (GGUF only), and loader-specific provenance
    meta: dict = field(default_factory=dict)
