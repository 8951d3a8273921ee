"""Error-compensating rounding of a weight onto any fixed grid (GPTQ, Frantar et al. 2022), and the Hessians of
each layer's inputs that it reads.

With H = sum_t x_t x_t^T over a linear's calibration inputs, the columns of W [N, K] are rounded one at a time
(largest diag(H) first) and each column's rounding error is pushed onto the columns not yet rounded, through H's
inverse, so that W x rather than W moves as little as possible. The grid is the caller's: a rule that rounds one
column given its index (e4m3 at a per-channel scale: calibrate/fp8_gptq.py; int4 at the per-group steps and zero
points the AWQ search fixed: calibrate/awq_gptq.py). Since every column's grid is fixed before the loop, the
columns may be rounded in any order and the format needs no permutation (no g_idx).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.stats import POINT_KINDS
from model_zoo.errors import ConfigError

# rule(column [N] fp32, its index in W) -> the column's values on the grid [N] fp32
ColumnRule = Callable[[torch.Tensor, int], torch.Tensor]


class Rounding(str, Enum):
    NEAREST = "nearest"  # each weight to its nearest grid value
    GPTQ = "gptq"  # error-compensating, from the calibration inputs' Hessians


@dataclass(frozen=True)
class GptqConfig:
    damp: float = 0.01  # added to H's diagonal, as a fraction of its mean: keeps the inverse well conditioned
    block: int = 128  # columns updated together (speed only: the result is the same up to fp32 rounding)
    act_order: bool = True  # round the columns with the largest input energy first, while most are still free
    tokens: int = 8192  # calibration tokens whose inputs make H (the first windows of the text)

    def __post_init__(self) -> None:
        if not 0.0 < self.damp <= 1.0:
            raise ConfigError(f"GPTQ damping must be in (0, 1], got {self.damp}")
        if self.block < 1:
            raise ConfigError(f"GPTQ block must be >= 1 column, got {self.block}")
        if self.tokens < 1:
            raise ConfigError(f"GPTQ needs at least one calibration token, got {self.tokens}")


class HessianCollector:
    """H [K, K] = sum over tokens of x x^T, each batch's sum in fp32 and the batches summed in fp64."""

    def __init__(self) -> None:
        self.h: torch.Tensor | None = None
        self.tokens = 0

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # [T, K]
        h = (x.T @ x).double()  # [K, K]
        self.h = h if self.h is None else self.h + h
        self.tokens += x.shape[0]


class LayerHessians:
    """The calibration windows run one layer at a time: each layer's Hessians come from its inputs given the layers
    before it as quantized (GPTQ's order), so later layers compensate what earlier ones lost. `cfg.tokens` of them."""

    def __init__(self, weights, windows: torch.Tensor, capture: CaptureConfig, cfg: GptqConfig = GptqConfig()):
        self.cfg = cfg
        windows = windows[: -(-cfg.tokens // windows.shape[1])]  # [n', L]: the first windows covering cfg.tokens
        self.runner = LayerwiseRunner(weights, windows, capture)

    @property
    def tokens(self) -> int:
        return self.runner.n_tokens

    def hessians(self, layer) -> dict[str, torch.Tensor]:
        """Capture point ("qkv", "o", "gate_up", "down") -> H [K, K] (fp64, CPU) of the float `layer`'s linears."""
        collectors = {k: HessianCollector() for k in POINT_KINDS}
        hidden = self.runner.hidden.clone()  # [n, L, H]: the float pass only observes; advance() moves on
        self.runner.run_layer(layer, lambda kind, x: collectors[kind].collect(x))
        self.runner.hidden = hidden
        return {k: c.h.cpu() for k, c in collectors.items()}

    def advance(self, quantized_layer) -> None:
        self.runner.run_layer(quantized_layer)


@torch.no_grad()
def gptq_round(work: torch.Tensor, h: torch.Tensor, rule: ColumnRule, cfg: GptqConfig = GptqConfig()) -> torch.Tensor:
    """W [N, K] (in the units `rule` rounds) and H [K, K] -> W_hat [N, K] fp32, each column on the grid `rule`
    gives it, chosen to minimise ||(W - W_hat) X|| column by column."""
    n, k = work.shape
    if h.shape != (k, k):
        raise ConfigError(f"Hessian of shape {tuple(h.shape)} for a weight with {k} inputs")
    h = h.double().cpu().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their columns cost nothing, round them plainly
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diag(h), descending=True, stable=True) if cfg.act_order else torch.arange(k)
    work, h = work.detach().float().cpu()[:, order], h[order][:, order]  # [N, K], [K, K]: copies
    u = _inverse_cholesky(h, cfg.damp).float()  # [K, K] upper: row i gives column i's error its spread
    rounded = torch.empty_like(work)  # [N, K]
    for b0 in range(0, k, cfg.block):
        b1 = min(b0 + cfg.block, k)
        blk, err = work[:, b0:b1].clone(), torch.empty(n, b1 - b0)  # [N, B], [N, B]
        for j in range(b1 - b0):
            q = rule(blk[:, j], int(order[b0 + j]))  # [N]
            rounded[:, b0 + j] = q
            e = (blk[:, j] - q) / u[b0 + j, b0 + j]  # [N]
            blk[:, j:] -= e[:, None] * u[b0 + j, b0 + j:b1][None, :]
            err[:, j] = e
        work[:, b1:] -= err @ u[b0:b1, b1:]  # the block's errors onto every later column
    out = torch.empty_like(rounded)
    out[:, order] = rounded
    return out


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising the damping until H is factorable."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    mean = float(torch.diag(h).mean())
    for attempt in range(6):
        l, info = torch.linalg.cholesky_ex(h + eye * (damp * 10 ** attempt * mean))
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(l), upper=True)
    raise ConfigError("GPTQ: the calibration inputs' Hessian is not positive definite even with damping")
