"""Error-compensating rounding of weights onto e4m3's grid (GPTQ, Frantar et al. 2022, on a float grid).

The format does not change: codes float8_e4m3fn [N, K] and one fp32 scale per output channel, given (amax / 448,
or calibrate/fp8_scale.py's search). Only which e4m3 value each weight takes changes. With H = sum_t x_t x_t^T over the
linear's calibration inputs, the columns are rounded one at a time (largest diag(H) first) and each column's
rounding error is pushed onto the columns not yet rounded, through H's inverse, so that W x rather than W moves
as little as possible. e4m3 keeps three mantissa bits (a relative step of 1/8), so round-to-nearest moves every
weight by up to 1/16 of itself; the compensation cancels much of what that does to the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.stats import POINT_KINDS
from model_zoo.errors import ConfigError
from model_zoo.quant.fp8 import quantize_weight_fp8, to_e4m3


class Fp8Rounding(str, Enum):
    NEAREST = "nearest"  # each weight to its nearest e4m3 value at its channel's scale
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
def gptq_fp8(w: torch.Tensor, h: torch.Tensor, cfg: GptqConfig = GptqConfig(),
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] and H [K, K] -> (w8 float8_e4m3fn [N, K], w_scale fp32 [N]), W ~ float(w8) * w_scale[:, None];
    the scale is round-to-nearest's (amax / 448) unless given, the codes minimise ||(W - W8) X|| column by column."""
    n, k = w.shape
    if h.shape != (k, k):
        raise ConfigError(f"Hessian of shape {tuple(h.shape)} for a weight with {k} inputs")
    if scale is None:
        _, scale = quantize_weight_fp8(w)  # [N]
    work = w.detach().float().cpu() / scale[:, None].cpu()  # [N, K] in code units: errors are pushed here
    h = h.double().cpu().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their columns cost nothing, round them plainly
    h[dead, dead] = 1.0
    order = torch.argsort(torch.diag(h), descending=True, stable=True) if cfg.act_order else torch.arange(k)
    work, h = work[:, order], h[order][:, order]
    u = _inverse_cholesky(h, cfg.damp).float()  # [K, K] upper: row i gives column i's error its spread
    codes = torch.empty_like(work)  # [N, K]
    for b0 in range(0, k, cfg.block):
        b1 = min(b0 + cfg.block, k)
        blk, err = work[:, b0:b1].clone(), torch.empty(n, b1 - b0)  # [N, B], [N, B]
        for j in range(b1 - b0):
            q = to_e4m3(blk[:, j]).float()  # [N]
            codes[:, b0 + j] = q
            e = (blk[:, j] - q) / u[b0 + j, b0 + j]  # [N]
            blk[:, j:] -= e[:, None] * u[b0 + j, b0 + j:b1][None, :]
            err[:, j] = e
        work[:, b1:] -= err @ u[b0:b1, b1:]  # the block's errors onto every later column
    w8 = torch.empty_like(codes)
    w8[:, order] = codes
    return to_e4m3(w8), scale  # the codes are e4m3 values already: the cast is exact


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising the damping until H is factorable."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    mean = float(torch.diag(h).mean())
    for attempt in range(6):
        l, info = torch.linalg.cholesky_ex(h + eye * (damp * 10 ** attempt * mean))
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(l), upper=True)
    raise ConfigError("GPTQ: the calibration inputs' Hessian is not positive definite even with damping")
