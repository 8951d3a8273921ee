"""LlamaConfig: the shape of a LLaMA-family decoder, from presets, HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from model_zoo.errors import ConfigError, UnsupportedArchitectureError
from model_zoo.rope import RopeScaling, RopeType

# HF `model_type` values whose weights and forward pass are exactly LLaMA's (Mistral's sliding window aside:
# its context is capped at the window, where the two attentions agree).
LLAMA_MODEL_TYPES = ("llama", "mistral")


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
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # Mistral v0.1; max_positions never exceeds it

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
        if self.sliding_window is not None and self.max_positions > self.sliding_window:
            raise ConfigError(f"a context of {self.max_positions} positions exceeds the sliding window of "
                              f"{self.sliding_window}, which fllama does not implement")

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

    def with_context(self, positions: int | None) -> "LlamaConfig":
        """The config limited to `positions` (prompt + reply) per sequence; None keeps the model's context."""
        if positions is None:
            return self
        if positions <= 1:
            raise ConfigError(f"--max-context must be at least 2 positions, got {positions}")
        if positions > self.max_positions:
            why = (f"Mistral's sliding window ({self.sliding_window}), which fllama does not implement, caps it"
                   if self.sliding_window == self.max_positions else "its max_position_embeddings")
            raise ConfigError(f"--max-context {positions} exceeds the model's context of {self.max_positions} "
                              f"positions ({why})")
        return self.replace(max_positions=positions)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "LlamaConfig":
        """From a transformers config.json dict; refuses what fllama would not compute exactly."""
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in LLAMA_MODEL_TYPES:
            what = model_type or (archs[0] if archs else "unknown")
            raise UnsupportedArchitectureError(
                f"unsupported architecture {what!r}: fllama runs LLaMA-family models (model_type 'llama' or "
                "'mistral')")
        _refuse_other_math(cfg)
        try:
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if not isinstance(rope, Mapping):
                raise ConfigError(f"rope_scaling must be an object, got {rope!r}")
            scaling = RopeScaling.from_hf(rope, max_pos)
            theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            window = cfg.get("sliding_window") if model_type == "mistral" else None
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
                max_positions=_context(max_pos, scaling, window),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_id=_first_id(cfg.get("bos_token_id")),
                eos_id=_first_id(cfg.get("eos_token_id")),
                name=str(cfg.get("_name_or_path") or model_type),
                rope_scaling=scaling,
                sliding_window=int(window) if window else None,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json holds a value of the wrong type ({e})") from None

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
            "max_position_embeddings": self.max_position_embeddings,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float16",
        }

    @property
    def max_position_embeddings(self) -> int:
        """config.json's field: the context, except for dynamic NTK, whose formula reads the original one."""
        dynamic = self.rope_scaling is not None and self.rope_scaling.kind is RopeType.DYNAMIC
        return self.rope_scaling.original_max_positions if dynamic else self.max_positions

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
        head_dim = int(key_len or 0) or hidden // n_heads
        rope_dims = meta.get(p + "rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise UnsupportedArchitectureError(f"RoPE on {rope_dims} of {head_dim} head dimensions is not supported")
        context = int(meta.get(p + "context_length", 4096))
        kind = str(meta.get(p + "rope.scaling.type", "linear" if p + "rope.scale_linear" in meta else "none"))
        if kind not in ("none", "linear"):
            raise UnsupportedArchitectureError(f"unsupported RoPE scaling {kind!r} in the GGUF file: fllama computes "
                                               "linear scaling and Llama-3's frequency factors")
        factor = float(meta.get(p + "rope.scaling.factor") or meta.get(p + "rope.scale_linear") or 1.0)
        scaling = RopeScaling(RopeType.LINEAR, factor, context) if kind == "linear" and factor != 1.0 else None
        return cls(
            hidden_size=hidden,
            n_layers=int(meta[p + "block_count"]),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(p + "attention.head_count_kv") or n_heads),
            ffn_size=int(meta[p + "feed_forward_length"]),
            vocab_size=int(vocab),
            head_dim=head_dim,
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            max_positions=context,
            rope_scaling=scaling,
            tie_embeddings=False,  # decided by the loader: no output.weight tensor means tied
            bos_id=_first_id(meta.get("tokenizer.ggml.bos_token_id")),
            eos_id=_first_id(meta.get("tokenizer.ggml.eos_token_id")),
            name=str(meta.get("general.name") or "gguf"),
        )


def _refuse_other_math(cfg: Mapping[str, Any]) -> None:
    """config.json fields that would change the forward pass beyond what fllama computes: refused by name."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported: fllama computes SiLU (SwiGLU) MLPs")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise UnsupportedArchitectureError(f"{field}: true is not supported: fllama's linears have no bias")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedArchitectureError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    # pretraining_tp > 1 only splits the same products into slices (transformers 5 ignores it): the math is equal
    for field in ("logits_scaling", "embedding_multiplier", "residual_multiplier", "attention_multiplier"):
        if cfg.get(field) not in (None, 1, 1.0):
            raise UnsupportedArchitectureError(f"{field} {cfg[field]!r} is not supported (LLaMA has no such scale)")


def _context(max_position_embeddings: int, scaling: RopeScaling | None, window: Any) -> int:
    """Positions a sequence may use: dynamic NTK extends the context by its factor; Mistral's window caps it."""
    context = max_position_embeddings
    if scaling is not None and scaling.kind is RopeType.DYNAMIC:
        context = int(max_position_embeddings * scaling.factor)
    return min(context, int(window)) if window else context


def _first_id(v: Any) -> int | None:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, bos_id=128000, eos_id=128001)
_LLAMA31_ROPE = RopeScaling(RopeType.LLAMA3, 8.0, 8192, 1.0, 4.0)
_LLAMA32_ROPE = RopeScaling(RopeType.LLAMA3, 32.0, 8192, 1.0, 4.0)

PRESETS: dict[str, LlamaConfig] = {
    "llama2-7b": LlamaConfig(4096, 32, 32, 32, 11008, 32000, name="llama2-7b"),
    "llama2-13b": LlamaConfig(5120, 40, 40, 40, 13824, 32000, name="llama2-13b"),
    "llama2-70b": LlamaConfig(8192, 80, 64, 8, 28672, 32000, name="llama2-70b"),
    "tinyllama-1.1b": LlamaConfig(2048, 22, 32, 4, 5632, 32000, max_positions=2048, name="tinyllama-1.1b"),
    "smollm2-135m": LlamaConfig(576, 30, 9, 3, 1536, 49152, rope_theta=100000.0, max_positions=8192,
                                tie_embeddings=True, name="smollm2-135m"),
    "llama3-8b": LlamaConfig(4096, 32, 32, 8, 14336, max_positions=8192, name="llama3-8b", **_LLAMA3),
    "llama3.1-8b": LlamaConfig(4096, 32, 32, 8, 14336, max_positions=131072, rope_scaling=_LLAMA31_ROPE,
                               name="llama3.1-8b", **_LLAMA3),
    "llama3.1-70b": LlamaConfig(8192, 80, 64, 8, 28672, max_positions=131072, rope_scaling=_LLAMA31_ROPE,
                                name="llama3.1-70b", **_LLAMA3),
    "llama3.2-1b": LlamaConfig(2048, 16, 32, 8, 8192, head_dim=64, max_positions=131072, tie_embeddings=True,
                               rope_scaling=_LLAMA32_ROPE, name="llama3.2-1b", **_LLAMA3),
    "llama3.2-3b": LlamaConfig(3072, 28, 24, 8, 8192, head_dim=128, max_positions=131072, tie_embeddings=True,
                               rope_scaling=_LLAMA32_ROPE, name="llama3.2-3b", **_LLAMA3),
    "mistral-7b": LlamaConfig(4096, 32, 32, 8, 14336, 32768, rope_theta=1000000.0, max_positions=32768,
                              name="mistral-7b"),
    "codellama-7b": LlamaConfig(4096, 32, 32, 32, 11008, 32016, rope_theta=1000000.0, max_positions=16384,
                                name="codellama-7b"),
}
