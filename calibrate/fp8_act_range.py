"""Static fp8 activation ranges chosen by what they do to the linears' outputs (`--calibrator output`).

A histogram calibrator (max, percentile, MSE, entropy) judges a range by the activations alone. On e4m3's grid a
per-tensor range only decides two things: which rare large values saturate (above amax) and which small ones fall
below the normals (2^-6 amax / 448) onto the subnormals' coarse absolute steps; everything between keeps e4m3's
relative step whatever the range. Which of those errors matters depends on the weights that read the input: a
clipped value in a channel whose weight column is small costs little, one feeding large weights a lot. So each
capture point of each layer takes, among candidates (the four calibrators' amaxes from the stats, and a grid of
2^(-j/4) below the largest value seen down to 1/32 of it), the amax whose rounding moves that point's linears'
outputs least on calibration tokens: sum over tokens of ||W x - W8 e4m3(x)||^2 / ||W8 x||^2 for each linear reading
the point (q, k and v; gate and up; o; down), W its float weight and W8 its quantized one, so that the weights' own
rounding is part of the judgement, and x the layer's inputs with the layers before it quantized. Each token's error
counts relative to its own outputs (an RMSNorm follows every residual add), so the few tokens with massive
activations do not decide every range alone. Candidates are ranked by a per-channel estimate of that error (T K
work each) and the best few judged exactly (T K N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.stats import POINT_KINDS
from model_zoo.errors import ConfigError
from model_zoo.quant.fp8 import FP8_MAX, to_e4m3
from model_zoo.weights import LayerWeights, ModelWeights


@dataclass(frozen=True)
class OutputRangeConfig:
    tokens: int = 2048  # calibration tokens whose outputs judge the candidates (the first windows of the text)
    steps: int = 4  # grid candidates per halving of the range
    octaves: int = 5  # the grid reaches the largest value seen / 2^octaves
    exact: int = 3  # candidates judged by the exact output error: the best by the per-channel estimate
    per_token: bool = True  # each token's error relative to its own output energy (see output_errors)

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError(f"the output range search needs at least one token, got {self.tokens}")
        if self.exact < 1:
            raise ConfigError(f"the output range search must judge at least one candidate exactly, got {self.exact}")
        if self.steps < 1 or self.octaves < 0:
            raise ConfigError(f"invalid range grid: {self.steps} steps per octave over {self.octaves} octaves")


@dataclass(frozen=True)
class QuantizedLinear:
    """One linear reading a capture point: its float weight and the e4m3 codes and scales that replace it."""

    weight: torch.Tensor  # [N, K] float
    codes: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] fp32


class LayerInputs:
    """The first windows covering cfg.tokens run one layer at a time: each layer's capture-point inputs, the layers
    before it quantized (so each range is chosen for the inputs the quantized model gives it)."""

    def __init__(self, weights: ModelWeights, windows: torch.Tensor, capture: CaptureConfig, tokens: int):
        windows = windows[: -(-tokens // windows.shape[1])]  # [n', L]
        self.runner = LayerwiseRunner(weights, windows, capture)

    def inputs(self, layer: LayerWeights) -> dict[str, torch.Tensor]:
        """Capture point -> x [T, K] (fp32, CPU) of the float `layer`; the hidden states do not move on."""
        seen: dict[str, list[torch.Tensor]] = {k: [] for k in POINT_KINDS}
        hidden = self.runner.hidden.clone()  # [n, L, H]
        self.runner.run_layer(layer, lambda kind, x: seen[kind].append(x.detach().reshape(-1, x.shape[-1])
                                                                       .to("cpu", torch.float32)))
        self.runner.hidden = hidden
        return {k: torch.cat(v) for k, v in seen.items()}  # [T, K] each

    def advance(self, quantized_layer: LayerWeights) -> None:
        self.runner.run_layer(quantized_layer)


def candidates(calibrated: dict[str, float], observed: float, cfg: OutputRangeConfig) -> list[float]:
    """The calibrators' amaxes and a grid below the largest value seen (`observed` or a calibrator's), ascending."""
    top = max([observed, *calibrated.values()])
    grid = [top * 2.0 ** (-j / cfg.steps) for j in range(cfg.steps * cfg.octaves + 1)]
    return sorted({a for a in [*calibrated.values(), *grid] if a > 0})


def static_scale(amax: float) -> torch.Tensor:
    """The fp32 input_scale a static amax becomes (amax / 448 in fp32, as the checkpoint stores it)."""
    return torch.tensor(amax, dtype=torch.float32) / FP8_MAX


def token_weights(x: torch.Tensor, linears: list[QuantizedLinear]) -> torch.Tensor:
    """[T]: 1 / the energy of each token's outputs, sum over the linears of ||W8 x_t||^2."""
    energy = sum((x.float() @ _dequantized(lin).T).pow(2).sum(dim=1) for lin in linears)  # [T]
    return 1.0 / energy.clamp_min(1e-30)


@torch.no_grad()
def output_errors(x: torch.Tensor, linears: list[QuantizedLinear], amaxes: list[float],
                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """[m]: sum over tokens t and linears of weights[t] ||W x_t - W8 q(x_t)||^2 for each amax (weights: 1 when
    None), q the static e4m3 rounding of model_zoo/quant/fp8.py (x * (1 / scale), saturating) and W8 the
    dequantized codes; x [T, K]. Per-token weights 1 / ||W8 x_t||^2 judge each token's error against its own
    outputs, as the RMSNorm after the residual add does: a token whose outputs are 100x the others' (the massive
    activations at a window's first token) counts as one token, not as 10^4 of them."""
    x = x.float()
    w_t = torch.ones(x.shape[0]) if weights is None else weights  # [T]
    refs = [x @ lin.weight.float().T for lin in linears]  # [T, N] each
    deq = [_dequantized(lin) for lin in linears]  # [N, K] each
    errs = torch.empty(len(amaxes), dtype=torch.float64)
    for i, amax in enumerate(amaxes):
        s = static_scale(amax)
        xq = to_e4m3(x * (1.0 / s)).float() * s  # [T, K]
        errs[i] = sum(float(((xq @ w.T - y).pow(2).sum(dim=1) * w_t).sum()) for w, y in zip(deq, refs))
    return errs


def _dequantized(lin: QuantizedLinear) -> torch.Tensor:
    return lin.codes.float() * lin.scale.float()[:, None]  # [N, K]


@torch.no_grad()
def channel_errors(x: torch.Tensor, linears: list[QuantizedLinear], amaxes: list[float],
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """[m]: output_errors estimated channel by channel, sum_k g_k sum_t weights[t] (q(x) - x)_tk^2 with g_k the
    energy of the dequantized weight columns reading input k, the weights' own rounding left out: exact when the
    rounding errors of different channels are uncorrelated, at T K work per candidate instead of T K N."""
    g = sum(_dequantized(lin).pow(2).sum(dim=0) for lin in linears)  # [K]
    x = x.float()
    w_t = (torch.ones(x.shape[0]) if weights is None else weights)[:, None]  # [T, 1]
    errs = torch.empty(len(amaxes), dtype=torch.float64)
    for i, amax in enumerate(amaxes):
        s = static_scale(amax)
        e = to_e4m3(x * (1.0 / s)).float() * s - x  # [T, K]
        errs[i] = float((e.pow(2).mul(w_t).sum(dim=0) * g).sum())
    return errs


def choose_amax(x: torch.Tensor, linears: list[QuantizedLinear], calibrated: dict[str, float],
                cfg: OutputRangeConfig) -> tuple[float, dict]:
    """The candidate amax with the least output error on x [T, K], and a report: the chosen amax, the calibrator
    with the least estimated error, and the chosen amax's estimated error relative to it. Every candidate is
    ranked by channel_errors; the best cfg.exact of them are judged by output_errors (ties: the larger range)."""
    amaxes = candidates(calibrated, float(x.abs().max()), cfg)
    if not amaxes:
        raise ConfigError("a capture point saw only zeros: no static range can be chosen for it")
    w_t = token_weights(x, linears) if cfg.per_token else None  # [T]
    rough = channel_errors(x, linears, amaxes, w_t)
    short = sorted(torch.argsort(rough, stable=True)[: cfg.exact].tolist())
    exact = output_errors(x, linears, [amaxes[j] for j in short], w_t)
    chosen = short[len(short) - 1 - int(torch.argmin(exact.flip(0)))]  # the last minimum: the largest range
    by_method = {m: float(rough[amaxes.index(a)]) for m, a in calibrated.items() if a > 0}
    method = min(by_method, key=by_method.get)
    return amaxes[chosen], {"amax": amaxes[chosen], "calibrator": method,
                            "error_vs_calibrator": float(rough[chosen]) / max(by_method[method], 1e-30)}


class OutputRanges:
    """`--calibrator output` over a model: each layer's four static ranges chosen on its own inputs (LayerInputs),
    given its quantized linears; `advance` moves the inputs past the quantized layer. `report` keeps, per layer,
    choose_amax's report of each capture point."""

    def __init__(self, weights: ModelWeights, windows: torch.Tensor, capture: CaptureConfig,
                 cfg: OutputRangeConfig = OutputRangeConfig()):
        self.cfg = cfg
        self.inputs = LayerInputs(weights, windows, capture, cfg.tokens)
        self.report: list[dict[str, dict]] = []

    def choose(self, layer: LayerWeights, linears: dict[str, list[QuantizedLinear]],
               calibrated: dict[str, dict[str, float]]) -> dict[str, float]:
        """Capture point -> amax; `linears`: each point's quantized linears; `calibrated`: each point's
        calibrator ranges (method name -> amax) from the stats."""
        x = self.inputs.inputs(layer)  # point -> [T, K]
        chosen, report = {}, {}
        for kind, lins in linears.items():
            if not calibrated.get(kind):
                raise ConfigError(f"the output calibrator needs the stats' ranges of capture point {kind!r}")
            chosen[kind], report[kind] = choose_amax(x[kind], lins, calibrated[kind], self.cfg)
        self.report.append(report)
        return chosen

    def advance(self, quantized_layer: LayerWeights) -> None:
        self.inputs.advance(quantized_layer)
