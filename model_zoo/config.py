"""LlamaConfig: the shape of a LLaMA-family decoder, from presets, HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from model_zoo.errors import ConfigError, UnsupportedArchitectureError

# HF `model_type` values whose weights and forward pass are exactly LLaMA's.
LLAMA_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_size: int
    vocab_size: int
    head_dim: int = 0  # 0 -> hidden_size // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_positions: int = 4096
    tie_embeddings: bool = False
    bos_id: int | None = 1
    eos_id: int | None = 2
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.n_heads <= 0 or self.hidden_size % self.n_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        for field in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_size", "vocab_size",
                      "head_dim", "max_positions"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError("rope_theta and norm_eps must be positive")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        per_layer = (self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
                     + 3 * self.hidden_size * self.ffn_size + 2 * self.hidden_size)
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + self.hidden_size

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str) -> "LlamaConfig":
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[key]

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        """From a transformers config.json dict; refuses architectures that are not LLaMA."""
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in LLAMA_MODEL_TYPES:
            what = model_type or (archs[0] if archs else "unknown")
            raise UnsupportedArchitectureError(
                f"unsupported architecture {what!r}: fllama runs LLaMA-family models (model_type 'llama')")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling {rope_type!r}: only plain RoPE is implemented")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0)
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                n_layers=int(cfg["num_hidden_layers"]),
                n_heads=int(cfg["num_attention_heads"]),
                n_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                ffn_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                head_dim=int(cfg.get("head_dim") or 0),
                rope_theta=float(theta),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_positions=int(cfg.get("max_position_embeddings", 4096)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_id=_first_id(cfg.get("bos_token_id")),
                eos_id=_first_id(cfg.get("eos_token_id")),
                name=str(cfg.get("_name_or_path") or model_type),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the field {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The transformers LlamaConfig fields (for config.json of exported checkpoints)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float16",
        }

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> "LlamaConfig":
        """From GGUF key/values (already decoded to Python values), llama architecture only."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise UnsupportedArchitectureError(
                f"unsupported GGUF architecture {arch!r}: fllama runs the 'llama' architecture")
        p = "llama."
        n_heads = int(meta[p + "attention.head_count"])
        hidden = int(meta[p + "embedding_length"])
        vocab = meta.get(p + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        key_len = meta.get(p + "attention.key_length")
        return cls(
            hidden_size=hidden,
            n_layers=int(meta[p + "block_count"]),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(p + "attention.head_count_kv") or n_heads),
            ffn_size=int(meta[p + "feed_forward_length"]),
            vocab_size=int(vocab),
            head_dim=int(key_len or 0),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            max_positions=int(meta.get(p + "context_length", 4096)),
            tie_embeddings=False,  # decided by the loader: no output.weight tensor means tied
            bos_id=_first_id(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_first_id(meta.get("tokenizer.ggml.eos_token_id")),
            name=str(meta.get("general.name") or "gguf"),
        )


def _first_id(v: Any) -> int | None:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


PRESETS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(4096, 32, 32, 32, 11008, 32000, name="llama2-7b"),
    "llama2-13b": LlamaConfig(5120, 40, 40, 40, 13824, 32000, name="llama2-13b"),
    "llama2-70b": LlamaConfig(8192, 80, 64, 8, 28672, 32000, name="llama2-70b"),
    "tinyllama-1.1b": LlamaConfig(2048, 22, 32, 4, 5632, 32000, max_positions=2048, name="tinyllama-1.1b"),
    "smollm2-135m": LlamaConfig(576, 30, 9, 3, 1536, 49152, rope_theta=100000.0, max_positions=8192,
                                tie_embeddings=True, name="smollm2-135m"),
}
