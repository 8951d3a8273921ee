"""Quantize a model layer by layer: per-channel INT8 or FP8 E4M3 (W8A8, optional SmoothQuant, dynamic or static
activations) or AWQ int4 (activation-aware scale + clip search, or plain round-to-nearest)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

from calibrate.awq import AwqConfig, LayerInput, apply_awq, check_group_size, search_layer, valid_group_sizes
from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from calibrate.ranges import compute_amax, scale_from_amax
from calibrate.smoothquant import apply_smoothing
from calibrate.stats import CalibStats, PointStats
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant.formats import (Scheme, amax_as_stored, awq_quantization_config, fp8_quantization_config,
                                     int8_quantization_config)
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear
from model_zoo.weights import ModelWeights

# which capture point feeds each linear
POINT_OF = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "wo": "o", "w_gate": "gate_up", "w_up": "gate_up",
            "w_down": "down"}


class AwqMethod(str, Enum):
    AWQ = "awq"  # scale + clip search
    RTN = "rtn"  # plain round-to-nearest per group (the baseline AWQ must beat)


W8A8 = (Scheme.INT8, Scheme.FP8)  # the schemes with activation quantization (static scales, SmoothQuant)
# --act static without --calibrator (docs/quality.md): MSE is int8's best by far; on e4m3's grid max, MSE and
# entropy come within a point of each other and max (no clipping, llm-compressor's FP8 observer) has the lowest KL
DEFAULT_CALIBRATOR = {Scheme.INT8: CalibMethod.MSE, Scheme.FP8: CalibMethod.MAX}

# AWQ group sizes the kernels are built for, largest (smallest file) first: the default is the first that fits
AWQ_GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True)
class QuantConfig:
    """None means "not given": where the option applies it takes its default (below), where it does not apply
    giving it is an error, never silently ignored."""

    scheme: Scheme
    act: ActQuant = ActQuant.DYNAMIC
    calibrator: CalibMethod | None = None  # --act static: DEFAULT_CALIBRATOR
    percentile: float | None = None  # --calibrator percentile: 99.99
    smooth: float | None = None  # SmoothQuant alpha
    group_size: int | None = None  # awq: the largest of AWQ_GROUP_SIZES that fits the model (with_group_size)
    awq_method: AwqMethod | None = None  # awq: the search

    def __post_init__(self) -> None:
        if self.smooth is not None and not 0.0 <= self.smooth <= 1.0:
            raise ConfigError(f"--smooth must be in [0, 1], got {self.smooth}")
        if self.scheme not in W8A8 and (self.smooth is not None or self.act == ActQuant.STATIC):
            raise ConfigError(f"--smooth and --act static apply to --scheme int8 and fp8, not {self.scheme.value}")
        static, awq = self.act == ActQuant.STATIC, self.scheme == Scheme.AWQ
        if self.calibrator is not None and not static:
            raise ConfigError("--calibrator chooses the ranges of --act static; it does nothing without it")
        calibrator = self.calibrator or (DEFAULT_CALIBRATOR[self.scheme] if static else None)
        if self.percentile is not None and calibrator != CalibMethod.PERCENTILE:
            raise ConfigError("--percentile applies to --act static --calibrator percentile only")
        if not awq and (self.group_size is not None or self.awq_method is not None):
            raise ConfigError(f"--{'group-size' if self.group_size is not None else 'method'} applies to "
                              f"--scheme awq only, not {self.scheme.value}")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"--group-size must be positive, got {self.group_size}")
        object.__setattr__(self, "calibrator", calibrator)
        if calibrator == CalibMethod.PERCENTILE and self.percentile is None:
            object.__setattr__(self, "percentile", 99.99)
        if awq and self.awq_method is None:
            object.__setattr__(self, "awq_method", AwqMethod.AWQ)

    def with_group_size(self, config: LlamaConfig) -> tuple["QuantConfig", str | None]:
        """AWQ without a group size: the largest of AWQ_GROUP_SIZES dividing every layer's input size, and a
        note saying so (None when nothing was chosen)."""
        if self.scheme != Scheme.AWQ or self.group_size is not None:
            return self, None
        fits = [g for g in AWQ_GROUP_SIZES if g in valid_group_sizes(config)]
        if not fits:
            raise ConfigError(f"none of the AWQ group sizes {', '.join(map(str, AWQ_GROUP_SIZES))} divides every "
                              f"input size of this model; give --group-size (sizes that do: "
                              f"{', '.join(map(str, valid_group_sizes(config)))})")
        note = (f"AWQ group size {fits[0]}: the largest of {', '.join(map(str, AWQ_GROUP_SIZES))} that divides "
                f"every layer of this model (--group-size chooses another)")
        return replace(self, group_size=fits[0]), note

    @property
    def needs_stats(self) -> bool:
        return self.scheme in W8A8 and (self.act == ActQuant.STATIC or self.smooth is not None)

    @property
    def reads_text(self) -> bool:
        """Whether quantizing runs the model on calibration text: the AWQ search, or the re-capture of static
        ranges after SmoothQuant."""
        return ((self.scheme == Scheme.AWQ and self.awq_method == AwqMethod.AWQ)
                or (self.smooth is not None and self.act == ActQuant.STATIC))

    def describe(self) -> dict:
        d = {"scheme": self.scheme.value}
        if self.scheme in W8A8:
            d.update(act=self.act.value, smooth=self.smooth,
                     calibrator=self.calibrator.value if self.act == ActQuant.STATIC else None)
            if self.act == ActQuant.STATIC and self.calibrator == CalibMethod.PERCENTILE:
                d["percentile"] = self.percentile
        elif self.scheme == Scheme.AWQ:
            d.update(group_size=self.group_size, zero_point=True, method=self.awq_method.value)
        return d


# progress(stage, layer_index, n_layers)
StageProgress = Callable[[str, int, int], None]


Recapture = Callable[[ModelWeights], dict[str, PointStats]]


def quantize_int8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None,
                  recapture: Recapture | None = None, progress: StageProgress | None = None) -> ModelWeights:
    """INT8 W8A8: optional SmoothQuant, per-channel int8 weights (fp16 scales, as exported), per-token or static
    activations; static amaxes are those an fp16 input_scale gives back."""
    def make(w: torch.Tensor, amax: float | None) -> Int8Linear:
        a = None if amax is None else amax_as_stored(amax)  # what a reader of the fp16 input_scale gets back
        return Int8Linear.from_dense(w, cfg.act, a, scale_dtype=torch.float16)

    return _quantize_w8a8(weights, cfg, stats, recapture, progress, make, QuantGrid.INT8)


def quantize_fp8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None,
                 recapture: Recapture | None = None, progress: StageProgress | None = None) -> ModelWeights:
    """FP8 E4M3 W8A8: optional SmoothQuant, per-channel e4m3 weights (fp32 scales), per-token or static
    activations whose ranges the calibrator judges on e4m3's grid; input_scale = amax / 448 in fp32."""
    def make(w: torch.Tensor, amax: float | None) -> Fp8Linear:
        a_scale = None if amax is None else float(scale_from_amax(torch.tensor(amax), QuantGrid.FP8))
        return Fp8Linear.from_dense(w, cfg.act, a_scale)

    return _quantize_w8a8(weights, cfg, stats, recapture, progress, make, QuantGrid.FP8)


def _quantize_w8a8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None, recapture: Recapture | None,
                   progress: StageProgress | None, make: Callable[[torch.Tensor, float | None], object],
                   grid: QuantGrid) -> ModelWeights:
    """W8A8: optional SmoothQuant from the stats' per-channel maxima, then per-channel weights and per-token
    (dynamic) or per-tensor calibrated (static) activation ranges, `make(W, amax)` building each linear.

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
    calib = None
    if points is not None:  # the percentile is set only for the percentile calibrator
        calib = CalibConfig(method=cfg.calibrator, **({} if cfg.percentile is None else {"percentile": cfg.percentile}))
    out = []
    for i, layer in enumerate(layers):
        amax = {}
        if points is not None:
            for kind in ("qkv", "o", "gate_up", "down"):
                p = points[f"layers.{i}.{kind}"]
                amax[kind] = (p.amax if cfg.calibrator == CalibMethod.MAX
                              else compute_amax(cfg.calibrator, p.hist, p.edges, calib, grid))
        linears = {attr: make(lin.dense_weight().float(), amax.get(POINT_OF[attr]))
                   for attr, lin in layer.linears().items()}
        out.append(replace(layer, **linears))
        if progress:
            progress("quantize", i, n)
    return replace(weights, layers=out, meta={**weights.meta, "scheme": cfg.scheme.value})


def quantize_awq(weights: ModelWeights, cfg: QuantConfig, windows: torch.Tensor | None, capture: CaptureConfig,
                 awq: AwqConfig | None = None, progress: StageProgress | None = None) -> tuple[ModelWeights, dict]:
    """AWQ int4: per layer, search scales and clips on that layer's real inputs, fold them, quantize
    round-to-nearest per group, and feed the next layer's search with this layer's output (awq.layer_input
    says with which of its weights). RTN skips the search. Returns the weights and a report of the search
    losses."""
    cfg, _ = cfg.with_group_size(weights.config)
    check_group_size(weights.config, cfg.group_size)
    awq = replace(awq or AwqConfig(), group_size=cfg.group_size)
    n = len(weights.layers)
    runner = None
    if cfg.awq_method == AwqMethod.AWQ:
        windows = windows[: -(-awq.search_tokens // windows.shape[1])]  # [n', L]: only what the search reads
        runner = LayerwiseRunner(weights, windows, capture)
    out, report = [], {"layers": []}
    if runner is not None:
        report["search_tokens"] = int(windows.numel())  # the first windows of the text; the rest are not read
    for i, layer in enumerate(weights.layers):
        original = layer
        if runner is not None:
            result = search_layer(layer, weights.config, runner.hidden, awq)
            layer = apply_awq(layer, result, weights.config)
            report["layers"].append({"alphas": result.alphas, "losses": result.losses})
        linears = {attr: AwqLinear.from_dense(lin.dense_weight().float(), cfg.group_size)
                   for attr, lin in layer.linears().items()}
        out.append(replace(layer, **linears))
        if runner is not None:  # what the next layer's search sees
            runner.run_layer({LayerInput.FLOAT: original, LayerInput.SCALED: layer,
                              LayerInput.QUANTIZED: out[-1]}[awq.layer_input])
        if progress:
            progress("awq" if runner is not None else "rtn", i, n)
    return replace(weights, layers=out, meta={**weights.meta, "scheme": "awq"}), report


def quantization_config_for(cfg: QuantConfig) -> dict | None:
    if cfg.scheme == Scheme.INT8:
        return int8_quantization_config(static=cfg.act == ActQuant.STATIC)
    if cfg.scheme == Scheme.FP8:
        return fp8_quantization_config(static=cfg.act == ActQuant.STATIC)
    if cfg.scheme == Scheme.AWQ:
        return awq_quantization_config(cfg.group_size)
    return None
