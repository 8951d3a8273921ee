"""RoPE frequencies, plain and scaled, computed as transformers' modeling_rope_utils computes them.

Scalings (config.json `rope_scaling`, or `rope_parameters` in transformers 5):
    linear   inv_freq / factor (positions stretched by `factor`).
    dynamic  NTK: with seq_len = the longest position + 1 of a forward call, beyond the original context
             theta becomes theta * (factor * seq_len / orig - (factor - 1)) ** (d / (d - 2)); within it, plain RoPE.
    llama3   (Llama-3.1 / 3.2) wavelengths above orig / low_freq_factor are divided by `factor`, those below
             orig / high_freq_factor kept, and those between interpolated smoothly.
Every step runs in fp32 torch ops in transformers' order, so the frequencies agree bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import torch

from model_zoo.errors import ConfigError, UnsupportedArchitectureError


class RopeType(str, Enum):
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeScaling:
    kind: RopeType
    factor: float
    original_max_positions: int  # llama3: the pre-training context; dynamic: max_position_embeddings
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RopeType(self.kind))
        if not self.factor >= 1.0:
            raise ConfigError(f"RoPE scaling factor must be >= 1, got {self.factor}")
        if self.original_max_positions <= 0:
            raise ConfigError(f"RoPE scaling needs a positive original context, got {self.original_max_positions}")
        if self.kind is RopeType.LLAMA3 and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"llama3 RoPE needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor} and {self.high_freq_factor}")

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any] | None, max_position_embeddings: int) -> "RopeScaling | None":
        """From config.json's rope_scaling / rope_parameters; None for plain RoPE; refuses other kinds."""
        if not rope:
            return None
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in ("default", None):
            return None
        if kind not in {t.value for t in RopeType}:
            raise UnsupportedArchitectureError(
                f"unsupported RoPE scaling {kind!r}: fllama computes llama3, linear and dynamic scaling")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedArchitectureError("partial_rotary_factor != 1 (RoPE on part of each head) is not "
                                               "supported")
        if "factor" not in rope:
            raise ConfigError(f"{kind} RoPE scaling lacks its 'factor'")
        if kind == RopeType.LLAMA3.value:
            return cls(RopeType.LLAMA3, float(rope["factor"]),
                       int(rope.get("original_max_position_embeddings") or max_position_embeddings),
                       float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0)))
        return cls(RopeType(kind), float(rope["factor"]), max_position_embeddings)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.kind.value, "factor": self.factor}
        if self.kind is RopeType.LLAMA3:
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_positions)
        return out

    def describe(self) -> str:
        if self.kind is RopeType.LLAMA3:
            return (f"llama3 (factor {self.factor:g}, low/high freq factor {self.low_freq_factor:g}/"
                    f"{self.high_freq_factor:g}, original context {self.original_max_positions})")
        return f"{self.kind.value} (factor {self.factor:g})"


def default_inv_freq(head_dim: int, theta: float | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [head_dim / 2]: 1 / theta ** (2i / d)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # [d/2]
    return 1.0 / (theta ** exponents)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: int | None = None,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 [head_dim / 2] for a forward call whose longest position + 1 is `seq_len` (only dynamic reads it;
    None: the frequencies within the original context)."""
    if scaling is None:
        return default_inv_freq(head_dim, theta, device)
    if scaling.kind is RopeType.LINEAR:
        return default_inv_freq(head_dim, theta, device) / scaling.factor
    if scaling.kind is RopeType.DYNAMIC:
        orig = scaling.original_max_positions
        if seq_len is None or seq_len <= orig:
            return default_inv_freq(head_dim, theta, device)
        # transformers takes seq_len as a tensor here, so the new base is an fp32 tensor
        seq = torch.tensor(seq_len, dtype=torch.int64, device=device)
        base = theta * ((scaling.factor * seq / orig) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
        return default_inv_freq(head_dim, base, device)
    return _llama3(default_inv_freq(head_dim, theta, device), scaling)


def _llama3(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    orig = s.original_max_positions
    low_wavelen, high_wavelen = orig / s.low_freq_factor, orig / s.high_freq_factor
    wavelen = 2 * math.pi / freq  # [d/2]
    scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def llama3_from_factors(factors: torch.Tensor, head_dim: int, theta: float,
                        original_max_positions: int) -> RopeScaling | None:
    """The llama3 scaling whose per-frequency divisors llama.cpp stored (GGUF `rope_freqs.weight`), or None.

    llama.cpp divides each frequency by factors[i]; Llama-3.1 and 3.2 use low/high freq factors 1 and 4 with
    `factor` the largest divisor. The candidate is accepted when its frequencies match to fp32 rounding."""
    if factors.numel() != head_dim // 2:
        return None
    candidate = RopeScaling(RopeType.LLAMA3, float(factors.max()), original_max_positions, 1.0, 4.0)
    freq = default_inv_freq(head_dim, theta)
    ours, theirs = _llama3(freq, candidate), freq / factors.float()
    return candidate if torch.allclose(ours, theirs, rtol=1e-5, atol=0.0) else None
