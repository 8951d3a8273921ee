"""What the AWQ search is: its options (`AwqConfig`), the groups of linears that share a scale, the clipped
linears, and what one layer's search returns (`AwqLayerResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from model_zoo.errors import ConfigError

QMAX = 15  # 4-bit codes 0..15
SCALE_RANGE_MIN = 1e-5  # a constant group still gets a positive quantization step (AutoAWQ's clamp)
ACT_SCALE_MIN = 1e-4  # channels that never fire keep a finite AWQ scale (AutoAWQ's clamp)
W_MEAN_EPS = 1e-4  # duo scaling's guard against a column of zeros (AutoAWQ's)


class LayerInput(str, Enum):
    """What the next layer's search gets as its input: this layer's output with its weights ..."""
    FLOAT = "float"  # as they were (AutoAWQ)
    SCALED = "scaled"  # scaled and clipped, not rounded
    QUANTIZED = "quantized"  # as the checkpoint holds them: the inputs the next layer will see
    # per layer, FLOAT or SCALED: whichever's search leaves the quantized output closer to the float model's
    # (calibrate.awq_choose; twice the search time); measured worse than SCALED on SmolLM2 (docs/quality.md)
    CHOOSE = "choose"


class ClipObjective(str, Enum):
    """What the clip search minimizes for each output row of a linear: the output error of ..."""
    GROUP = "group"  # each group of G inputs on its own, groups chosen independently (AutoAWQ)
    ROW = "row"  # the whole row, all its groups together: groups revisited in turn, each given the others


@dataclass(frozen=True)
class AwqConfig:
    group_size: int = 128
    zero_point: bool = True  # asymmetric 0..15 codes; the AWQ GEMM export needs True
    n_grid: int = 20  # alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid}; alpha 0 is plain round-to-nearest
    duo_scaling: bool = True  # s = x_mean^a / w_mean^(1-a) (AutoAWQ's default), else s = x_mean^a
    # v_proj -> o_proj scales under GQA, shared by the query heads of a KV head (MHA models always get o scales):
    # exact and cheap, but no measurable gain on SmolLM2-135M (docs/quality.md), so off by default
    gqa_o_scaling: bool = False
    # True: candidates are judged with each group's quantization step rounded to fp16, as the checkpoint stores it
    # (AutoAWQ on a GPU computes in fp16 too); the default, fp32 steps, measured better on SmolLM2 (docs/quality.md)
    fp16_steps: bool = False
    clip: bool = True  # weight-clipping search
    clip_grid: int = 20  # shrink ratios 1 - i/clip_grid ...
    max_shrink: float = 0.5  # ... for i < max_shrink * clip_grid: 1.0 down to 0.55 (AutoAWQ)
    # ROW measured worse than GROUP on SmolLM2 at g32 and g64 (31.59 / 32.99 against 31.36 / 32.47)
    clip_objective: ClipObjective = ClipObjective.GROUP
    clip_tokens: int = 4096  # tokens (strided over the captured ones) for the clip search; AutoAWQ takes 512
    search_tokens: int = 4096  # the scale search uses the first samples that hold this many tokens
    layer_input: LayerInput = LayerInput.SCALED

    def __post_init__(self) -> None:
        for name in ("group_size", "n_grid", "clip_grid", "clip_tokens", "search_tokens"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ConfigError(f"AWQ {name} must be a positive integer, got {getattr(self, name)}")
        object.__setattr__(self, "layer_input", LayerInput(self.layer_input))  # a name read back from JSON
        object.__setattr__(self, "clip_objective", ClipObjective(self.clip_objective))
        if not 0.0 <= self.max_shrink < 1.0:
            raise ConfigError(f"AWQ max_shrink must be in [0, 1), got {self.max_shrink}")

    @property
    def step_dtype(self) -> torch.dtype | None:
        return torch.float16 if self.fp16_steps else None

    @property
    def shrink_ratios(self) -> list[float]:
        n = max(1, int(self.max_shrink * self.clip_grid))  # 1.0 (no clipping) is always a candidate
        return [1.0 - i / self.clip_grid for i in range(n)]


@dataclass
class AwqLayerResult:
    # "qkv" [H], "o" [kv_size] (one per v_proj row), "gate_up" [H], "down" [F]
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    clips: dict[str, torch.Tensor] = field(default_factory=dict)  # "wv", "wo", ... -> clip max [N, K/G]
    losses: dict[str, float] = field(default_factory=dict)  # "qkv", "qkv.rtn", "clip.wv", "clip.wv.none", ...
    alphas: dict[str, float | None] = field(default_factory=dict)  # the chosen alpha; None: s = 1 won
    chosen_input: str | None = None  # layer_input=choose: the LayerInput this layer was searched on


@dataclass(frozen=True)
class ScaleGroup:
    name: str  # the capture point of layer_forward's observer: the shared input
    linears: tuple[str, ...]  # linears reading the input: their columns are multiplied by s
    prev: str  # what produced the input: its weight (a norm) or output rows (a linear) are divided by s


# Architecture as data, in AutoAWQ's order; later groups are searched on the already-scaled weights.
SCALE_GROUPS: tuple[ScaleGroup, ...] = (
    ScaleGroup("qkv", ("wq", "wk", "wv"), "attn_norm"),
    ScaleGroup("o", ("wo",), "wv"),  # v row j feeds o column j of every query head sharing its KV head
    ScaleGroup("gate_up", ("w_gate", "w_up"), "ffn_norm"),
    ScaleGroup("down", ("w_down",), "w_up"),  # silu(gate) * (up / s) = a / s
)
# Clipped linears and the capture point that feeds each. q and k are not clipped: AutoAWQ skips them
# because the attention scores are too sensitive to their error.
CLIP_INPUTS: dict[str, str] = {"wv": "qkv", "wo": "o", "w_gate": "gate_up", "w_up": "gate_up", "w_down": "down"}
