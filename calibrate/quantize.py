"""Quantize a model layer by layer: per-channel INT8 (W8A8, optional SmoothQuant, dynamic or static
activations) or AWQ int4 (activation-aware scale + clip search, or plain round-to-nearest)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

from calibrate.awq import AwqConfig, apply_awq, check_group_size, search_layer
from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.methods import CalibConfig, CalibMethod
from calibrate.ranges import compute_amax
from calibrate.smoothquant import apply_smoothing
from calibrate.stats import CalibStats, PointStats
from model_zoo.errors import ConfigError
from model_zoo.quant.formats import Scheme, amax_as_stored, awq_quantization_config, int8_quantization_config
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import AwqLinear, Int8Linear
from model_zoo.weights import ModelWeights

# which capture point feeds each linear
POINT_OF = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "wo": "o", "w_gate": "gate_up", "w_up": "gate_up",
            "w_down": "down"}


class AwqMethod(str, Enum):
    AWQ = "awq"  # scale + clip search
    RTN = "rtn"  # plain round-to-nearest per group (the baseline AWQ must beat)


@dataclass(frozen=True)
class QuantConfig:
    scheme: Scheme
    act: ActQuant = ActQuant.DYNAMIC
    calibrator: CalibMethod = CalibMethod.PERCENTILE
    percentile: float = 99.99
    smooth: float | None = None  # SmoothQuant alpha
    group_size: int = 128
    awq_method: AwqMethod = AwqMethod.AWQ

    def __post_init__(self) -> None:
        if self.smooth is not None and not 0.0 <= self.smooth <= 1.0:
            raise ConfigError(f"--smooth must be in [0, 1], got {self.smooth}")
        if self.scheme != Scheme.INT8 and (self.smooth is not None or self.act == ActQuant.STATIC):
            raise ConfigError("--smooth and --act static apply to --scheme int8 only")
        if self.group_size < 1:
            raise ConfigError(f"--group-size must be positive, got {self.group_size}")

    @property
    def needs_stats(self) -> bool:
        return self.scheme == Scheme.INT8 and (self.act == ActQuant.STATIC or self.smooth is not None)

    def describe(self) -> dict:
        d = {"scheme": self.scheme.value}
        if self.scheme == Scheme.INT8:
            d.update(act=self.act.value, smooth=self.smooth,
                     calibrator=self.calibrator.value if self.act == ActQuant.STATIC else None)
            if self.act == ActQuant.STATIC and self.calibrator == CalibMethod.PERCENTILE:
                d["percentile"] = self.percentile
        elif self.scheme == Scheme.AWQ:
            d.update(group_size=self.group_size, zero_point=True, method=self.awq_method.value)
        return d


# progress(stage, layer_index, n_layers)
StageProgress = Callable[[str, int, int], None]


def quantize_int8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None,
                  recapture: Callable[[ModelWeights], dict[str, PointStats]] | None = None,
                  progress: StageProgress | None = None) -> ModelWeights:
    """W8A8: optional SmoothQuant from the stats' per-channel maxima, then per-channel int8 weights and
    per-token (dynamic) or per-tensor calibrated (static) activation scales.

    With smoothing and static activations, the smoothed model's activations are captured again
    (`recapture`), since the stats describe the unsmoothed ones."""
    n = len(weights.layers)
    layers = list(weights.layers)
    if cfg.smooth is not None:
        for i, layer in enumerate(layers):
            layers[i] = apply_smoothing(layer, stats.points[f"layers.{i}.qkv"].max_abs,
                                        stats.points[f"layers.{i}.gate_up"].max_abs, cfg.smooth,
                                        stats.points[f"layers.{i}.down"].max_abs)
            if progress:
                progress("smooth", i, n)
    smoothed = replace(weights, layers=layers)
    points = None
    if cfg.act == ActQuant.STATIC:
        points = recapture(smoothed) if cfg.smooth is not None else stats.points
    calib = CalibConfig(method=cfg.calibrator, percentile=cfg.percentile)
    out = []
    for i, layer in enumerate(layers):
        amax = {}
        if points is not None:
            for kind in ("qkv", "o", "gate_up", "down"):
                p = points[f"layers.{i}.{kind}"]
                raw = p.amax if cfg.calibrator == CalibMethod.MAX else compute_amax(cfg.calibrator, p.hist, p.edges, calib)
                amax[kind] = amax_as_stored(raw)  # what a reader of the fp16 input_scale gets back
        linears = {attr: Int8Linear.from_dense(lin.dense_weight().float(), cfg.act, amax.get(POINT_OF[attr]),
                                               scale_dtype=torch.float16)
                   for attr, lin in layer.linears().items()}
        out.append(replace(layer, **linears))
        if progress:
            progress("quantize", i, n)
    meta = {**weights.meta, "scheme": "int8"}
    return replace(weights, layers=out, meta=meta)


def quantize_awq(weights: ModelWeights, cfg: QuantConfig, windows: torch.Tensor | None, capture: CaptureConfig,
                 awq: AwqConfig | None = None, progress: StageProgress | None = None) -> tuple[ModelWeights, dict]:
    """AWQ int4: per layer, search scales and clips on that layer's real inputs, fold them, quantize
    round-to-nearest per group, and feed the next layer with the scaled (unquantized) layer, as AutoAWQ
    does. RTN skips the search. Returns the weights and a report of the search losses."""
    check_group_size(weights.config, cfg.group_size)
    awq = replace(awq or AwqConfig(), group_size=cfg.group_size)
    n = len(weights.layers)
    runner = LayerwiseRunner(weights, windows, capture) if cfg.awq_method == AwqMethod.AWQ else None
    out, report = [], {"layers": []}
    for i, layer in enumerate(weights.layers):
        if runner is not None:
            result = search_layer(layer, weights.config, runner.hidden, awq)
            layer = apply_awq(layer, result)
            report["layers"].append({"alphas": result.alphas, "losses": result.losses})
            runner.run_layer(layer)
        linears = {attr: AwqLinear.from_dense(lin.dense_weight().float(), cfg.group_size)
                   for attr, lin in layer.linears().items()}
        out.append(replace(layer, **linears))
        if progress:
            progress("awq" if runner is not None else "rtn", i, n)
    return replace(weights, layers=out, meta={**weights.meta, "scheme": "awq"}), report


def quantization_config_for(cfg: QuantConfig) -> dict | None:
    if cfg.scheme == Scheme.INT8:
        return int8_quantization_config(static=cfg.act == ActQuant.STATIC)
    if cfg.scheme == Scheme.AWQ:
        return awq_quantization_config(cfg.group_size)
    return None
