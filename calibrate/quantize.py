"""Quantize a model layer by layer: per-channel INT8 or FP8 E4M3 (W8A8, optional SmoothQuant, dynamic or static
activations) or AWQ int4 (activation-aware scale + clip search, or plain round-to-nearest)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

from calibrate.awq import AwqConfig, LayerInput, apply_awq, check_group_size, search_layer, valid_group_sizes
from calibrate.awq_choose import InputChooser
from calibrate.capture import CaptureConfig, LayerwiseRunner
from calibrate.awq_gptq import gptq_awq
from calibrate.fp8_gptq import gptq_fp8
from calibrate.fp8_act_range import OutputRanges, QuantizedLinear
from calibrate.fp8_scale import Fp8WeightScale, search_scale_fp8
from calibrate.gptq_round import GptqConfig, LayerHessians, Rounding
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from calibrate.ranges import compute_amax, scale_from_amax
from calibrate.smoothquant import apply_smoothing
from calibrate.stats import CalibStats, PointStats
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant.formats import (Scheme, amax_as_stored, awq_quantization_config, fp8_quantization_config,
                                     int8_quantization_config)
from model_zoo.quant.fp8 import quantize_weight_fp8, to_e4m3
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear
from model_zoo.weights import LayerWeights, ModelWeights

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
# fp8 weights without --rounding / --weight-scale (docs/quality.md): GPTQ on e4m3's grid, scales searched
DEFAULT_FP8_ROUNDING = Rounding.GPTQ
DEFAULT_FP8_WEIGHT_SCALE = Fp8WeightScale.SEARCH
# fp8's GPTQ Hessians and scale search read the first 32,768 calibration tokens, as AWQ's GPTQ: on SmolLM2 2-7% less
# KL than 8,192 in every mode measured (docs/quality.md), for 2.4x the CPU time; GPTQ's usual damping
FP8_GPTQ = GptqConfig(tokens=32768)
# awq weights without --rounding (docs/quality.md): GPTQ at the grid the search fixed; --method rtn is nearest
DEFAULT_AWQ_ROUNDING = Rounding.GPTQ
# int4's GPTQ reads 8x the search's text, with 10x fp8's damping: on the search's 4,096 tokens alone down_proj's
# [1536, 1536] Hessian fits that text and perplexity rises (docs/quality.md)
AWQ_GPTQ = GptqConfig(damp=0.1, tokens=32768)

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
    rounding: Rounding | None = None  # fp8 and awq: how weights take grid values (DEFAULT_FP8/AWQ_ROUNDING)
    weight_scale: Fp8WeightScale | None = None  # fp8: each channel's scale (DEFAULT_FP8_WEIGHT_SCALE)

    def __post_init__(self) -> None:
        if self.smooth is not None and not 0.0 <= self.smooth <= 1.0:
            raise ConfigError(f"--smooth must be in [0, 1], got {self.smooth}")
        if self.scheme not in W8A8 and (self.smooth is not None or self.act == ActQuant.STATIC):
            raise ConfigError(f"--smooth and --act static apply to --scheme int8 and fp8, not {self.scheme.value}")
        static, awq = self.act == ActQuant.STATIC, self.scheme == Scheme.AWQ
        if self.calibrator is not None and not static:
            raise ConfigError("--calibrator chooses the ranges of --act static; it does nothing without it")
        calibrator = self.calibrator or (DEFAULT_CALIBRATOR[self.scheme] if static else None)
        if calibrator == CalibMethod.OUTPUT and self.scheme != Scheme.FP8:
            raise ConfigError("--calibrator output applies to --scheme fp8 (it judges e4m3's rounding at the "
                              "linears' outputs); int8 takes max, percentile, mse or entropy")
        if self.percentile is not None and calibrator != CalibMethod.PERCENTILE:
            raise ConfigError("--percentile applies to --act static --calibrator percentile only")
        if not awq and (self.group_size is not None or self.awq_method is not None):
            raise ConfigError(f"--{'group-size' if self.group_size is not None else 'method'} applies to "
                              f"--scheme awq only, not {self.scheme.value}")
        if self.rounding is not None and self.scheme not in (Scheme.FP8, Scheme.AWQ):
            raise ConfigError(f"--rounding applies to --scheme fp8 and awq only, not {self.scheme.value}")
        if self.weight_scale is not None and self.scheme != Scheme.FP8:
            raise ConfigError(f"--weight-scale applies to --scheme fp8 only, not {self.scheme.value}")
        if self.awq_method == AwqMethod.RTN and self.rounding == Rounding.GPTQ:
            raise ConfigError("--method rtn is round-to-nearest; --rounding gptq needs --method awq")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"--group-size must be positive, got {self.group_size}")
        object.__setattr__(self, "calibrator", calibrator)
        if calibrator == CalibMethod.PERCENTILE and self.percentile is None:
            object.__setattr__(self, "percentile", 99.99)
        if awq and self.awq_method is None:
            object.__setattr__(self, "awq_method", AwqMethod.AWQ)
        if awq and self.rounding is None:
            object.__setattr__(self, "rounding", DEFAULT_AWQ_ROUNDING if self.awq_method == AwqMethod.AWQ
                               else Rounding.NEAREST)
        if self.scheme == Scheme.FP8:
            object.__setattr__(self, "rounding", self.rounding or DEFAULT_FP8_ROUNDING)
            object.__setattr__(self, "weight_scale", self.weight_scale or DEFAULT_FP8_WEIGHT_SCALE)

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
        """Whether quantizing runs the model on calibration text: the AWQ search, fp8's GPTQ rounding or scale
        search, or the re-capture of static ranges after SmoothQuant."""
        return ((self.scheme == Scheme.AWQ and self.awq_method == AwqMethod.AWQ) or self.fp8_reads_inputs
                or self.output_ranges or (self.smooth is not None and self.act == ActQuant.STATIC))

    @property
    def output_ranges(self) -> bool:
        """Whether static ranges are chosen at the linears' outputs (calibrate/fp8_act_range.py)."""
        return self.act == ActQuant.STATIC and self.calibrator == CalibMethod.OUTPUT

    @property
    def fp8_reads_inputs(self) -> bool:
        """Whether fp8 weights are chosen from the calibration inputs (their Hessians)."""
        return self.scheme == Scheme.FP8 and (self.rounding == Rounding.GPTQ
                                              or self.weight_scale == Fp8WeightScale.SEARCH)

    def describe(self) -> dict:
        d = {"scheme": self.scheme.value}
        if self.scheme in W8A8:
            d.update(act=self.act.value, smooth=self.smooth,
                     calibrator=self.calibrator.value if self.act == ActQuant.STATIC else None)
            if self.act == ActQuant.STATIC and self.calibrator == CalibMethod.PERCENTILE:
                d["percentile"] = self.percentile
            if self.scheme == Scheme.FP8:
                d.update(rounding=self.rounding.value, weight_scale=self.weight_scale.value)
        elif self.scheme == Scheme.AWQ:
            d.update(group_size=self.group_size, zero_point=True, method=self.awq_method.value,
                     rounding=self.rounding.value)
        return d


# progress(stage, layer_index, n_layers)
StageProgress = Callable[[str, int, int], None]


Recapture = Callable[[ModelWeights], dict[str, PointStats]]
# (layer index, layer, capture point -> static amax) -> the layer's quantized linears by attribute
LayerQuantizer = Callable[[int, LayerWeights, dict[str, float]], dict[str, object]]


def quantize_int8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None,
                  recapture: Recapture | None = None, progress: StageProgress | None = None) -> ModelWeights:
    """INT8 W8A8: optional SmoothQuant, per-channel int8 weights (fp16 scales, as exported), per-token or static
    activations; static amaxes are those an fp16 input_scale gives back."""
    def make(w: torch.Tensor, amax: float | None) -> Int8Linear:
        a = None if amax is None else amax_as_stored(amax)  # what a reader of the fp16 input_scale gets back
        return Int8Linear.from_dense(w, cfg.act, a, scale_dtype=torch.float16)

    return _quantize_w8a8(weights, cfg, stats, recapture, progress, _per_linear(make), QuantGrid.INT8)


def quantize_fp8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None,
                 recapture: Recapture | None = None, progress: StageProgress | None = None,
                 windows: torch.Tensor | None = None, capture: CaptureConfig = CaptureConfig(),
                 gptq: GptqConfig = FP8_GPTQ) -> ModelWeights:
    """FP8 E4M3 W8A8: optional SmoothQuant, per-channel e4m3 weights (fp32 scales, amax / 448 or searched:
    cfg.weight_scale) rounded to nearest or by GPTQ (cfg.rounding), both judged on the first `gptq.tokens` of the
    calibration `windows` [n, L]; per-token or static activations whose ranges the calibrator judges on e4m3's
    grid (`output`: at the outputs of the quantized linears, calibrate/fp8_act_range.py); input_scale = amax / 448
    in fp32."""
    def a_scale(amax: float | None) -> float | None:
        return None if amax is None else float(scale_from_amax(torch.tensor(amax), QuantGrid.FP8))

    if not cfg.fp8_reads_inputs and not cfg.output_ranges:
        make = _per_linear(lambda w, amax: Fp8Linear.from_dense(w, cfg.act, a_scale(amax)))
        return _quantize_w8a8(weights, cfg, stats, recapture, progress, make, QuantGrid.FP8)
    if windows is None:
        raise ConfigError("fp8 GPTQ rounding, scale search and --calibrator output need calibration windows")
    inputs = LayerHessians(weights, windows, capture, gptq) if cfg.fp8_reads_inputs else None
    ranges = OutputRanges(weights, windows, capture) if cfg.output_ranges else None

    def fp8_layer(i: int, layer: LayerWeights, amax: dict) -> dict[str, Fp8Linear]:
        hessians = inputs.hessians(layer) if inputs else {}  # this layer's inputs, the layers before it quantized
        dense = {attr: lin.dense_weight().float() for attr, lin in layer.linears().items()}  # [N, K] each
        codes = {attr: _fp8_weight(w, hessians.get(POINT_OF[attr]), cfg, inputs.cfg if inputs else GptqConfig())
                 for attr, w in dense.items()}
        if ranges:  # amax: each point's calibrator ranges, the candidates
            readers = {k: [QuantizedLinear(dense[a], *codes[a]) for a in dense if POINT_OF[a] == k] for k in amax}
            amax = ranges.choose(layer, readers, amax)
        linears = {attr: Fp8Linear(w8, w_scale, cfg.act, a_scale(amax.get(POINT_OF[attr])), dtype=dense[attr].dtype)
                   for attr, (w8, w_scale) in codes.items()}
        for moving in (inputs, ranges):
            if moving:
                moving.advance(replace(layer, **linears))
        return linears

    return _quantize_w8a8(weights, cfg, stats, recapture, progress, fp8_layer, QuantGrid.FP8)


def _fp8_weight(w: torch.Tensor, h: torch.Tensor, cfg: QuantConfig, gptq: GptqConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [N, K], fp32 scale [N]) of W [N, K] by cfg's scale and rounding, H [K, K] its inputs'."""
    scale = search_scale_fp8(w, h) if cfg.weight_scale == Fp8WeightScale.SEARCH else quantize_weight_fp8(w)[1]
    if cfg.rounding == Rounding.GPTQ:
        return gptq_fp8(w, h, gptq, scale)
    return to_e4m3(w / scale[:, None]), scale  # [N, K]: the fp32 division of quantize_weight_fp8


def _per_linear(make: Callable[[torch.Tensor, float | None], object]) -> LayerQuantizer:
    """A LayerQuantizer building each linear alone, `make(W, amax of its input or None)`."""
    return lambda i, layer, amax: {attr: make(lin.dense_weight().float(), amax.get(POINT_OF[attr]))
                                   for attr, lin in layer.linears().items()}


def _quantize_w8a8(weights: ModelWeights, cfg: QuantConfig, stats: CalibStats | None, recapture: Recapture | None,
                   progress: StageProgress | None, quantize_layer: LayerQuantizer, grid: QuantGrid) -> ModelWeights:
    """W8A8: optional SmoothQuant from the stats' per-channel maxima, then per-channel weights and per-token
    (dynamic) or per-tensor calibrated (static) activation ranges, `quantize_layer` building each layer's linears
    (in layer order).

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
        method = None if cfg.output_ranges else cfg.calibrator  # output: every histogram method's, the candidates
        calib = CalibConfig(method=method, **({} if cfg.percentile is None else {"percentile": cfg.percentile}))
    out = []
    for i, layer in enumerate(layers):
        amax = {}
        if points is not None:
            for kind in ("qkv", "o", "gate_up", "down"):
                p = points[f"layers.{i}.{kind}"]
                ranges = {m: p.amax if m == CalibMethod.MAX else compute_amax(m, p.hist, p.edges, calib, grid)
                          for m in (calib.methods if cfg.output_ranges else (cfg.calibrator,))}
                amax[kind] = {m.value: a for m, a in ranges.items()} if cfg.output_ranges else ranges[cfg.calibrator]
        out.append(replace(layer, **quantize_layer(i, layer, amax)))
        if progress:
            progress("quantize", i, n)
    return replace(weights, layers=out, meta={**weights.meta, "scheme": cfg.scheme.value})


def quantize_awq(weights: ModelWeights, cfg: QuantConfig, windows: torch.Tensor | None, capture: CaptureConfig,
                 awq: AwqConfig | None = None, progress: StageProgress | None = None,
                 gptq: GptqConfig = AWQ_GPTQ) -> tuple[ModelWeights, dict]:
    """AWQ int4: per layer, search scales and clips on that layer's real inputs, fold them, round each group
    to nearest or by GPTQ at the grid they fix (cfg.rounding; its Hessians from the first windows, the layers
    before quantized; it aims at the weights before clipping), and feed the next layer's search with this layer's
    output (awq.layer_input says with which of its weights). RTN skips the search. Returns the weights and a
    report of the search losses."""
    cfg, _ = cfg.with_group_size(weights.config)
    check_group_size(weights.config, cfg.group_size)
    awq = replace(awq or AwqConfig(), group_size=cfg.group_size)
    n = len(weights.layers)
    runner = chooser = hessians = None

    def rtn(layer: LayerWeights) -> LayerWeights:
        return replace(layer, **{attr: AwqLinear.from_dense(lin.dense_weight().float(), cfg.group_size)
                                 for attr, lin in layer.linears().items()})

    if cfg.awq_method == AwqMethod.AWQ:
        if cfg.rounding == Rounding.GPTQ:
            hessians = LayerHessians(weights, windows, capture, gptq)
        windows = windows[: -(-awq.search_tokens // windows.shape[1])]  # [n', L]: only what the search reads
        runner = LayerwiseRunner(weights, windows, capture)
        if awq.layer_input == LayerInput.CHOOSE:
            chooser = InputChooser(runner, LayerwiseRunner(weights, windows, capture),
                                   LayerwiseRunner(weights, windows, capture), rtn)
    out, report = [], {"layers": []}
    if runner is not None:
        report["search_tokens"] = int(windows.numel())  # the first windows of the text; the rest are not read
    if hessians is not None:
        report["gptq_tokens"] = hessians.tokens
    for i, layer in enumerate(weights.layers):
        original = layer
        if runner is not None:
            result = (chooser.search(layer, awq) if chooser
                      else search_layer(layer, weights.config, runner.hidden, awq))
            layer = apply_awq(layer, result, weights.config)
            report["layers"].append({"alphas": result.alphas, "losses": result.losses,
                                     **({"input": result.chosen_input} if chooser else {})})
        if hessians is None:
            out.append(rtn(layer))
        else:  # GPTQ aims at the scaled weights before clipping: the clips set the grids only
            target = apply_awq(original, replace(result, clips={}), weights.config)
            out.append(_gptq_layer(layer, target, result.clips, hessians, cfg.group_size))
        if chooser:
            chooser.advance(original, layer, out[-1])
        elif runner is not None:  # what the next layer's search sees
            runner.run_layer({LayerInput.FLOAT: original, LayerInput.SCALED: layer,
                              LayerInput.QUANTIZED: out[-1]}[awq.layer_input])
        if progress:
            progress("awq" if runner is not None else "rtn", i, n)
    return replace(weights, layers=out, meta={**weights.meta, "scheme": "awq"}), report


def awq_gptq_notes(cfg: QuantConfig, tokens: int) -> list[str]:
    """A line when AWQ's GPTQ rounding would read less text than it was measured to need, else none."""
    if cfg.scheme != Scheme.AWQ or cfg.rounding != Rounding.GPTQ or tokens >= AWQ_GPTQ.tokens:
        return []
    return [f"GPTQ rounding reads {tokens:,} tokens of text here; on SmolLM2 it needed about {AWQ_GPTQ.tokens:,} to "
            f"beat nearest rounding (docs/quality.md): give more --samples, or --rounding nearest"]


def _gptq_layer(layer: LayerWeights, target: LayerWeights, clips: dict[str, torch.Tensor], inputs: LayerHessians,
                group_size: int) -> LayerWeights:
    """`layer` scaled and clipped, whose inputs make the Hessians, rounded by GPTQ toward `target`'s linears (the
    same scales, unclipped) on the grids `clips` set, so what clipping cuts is compensated like a rounding error;
    the inputs move on past it."""
    h = inputs.hessians(layer)  # capture point -> [K, K]
    quantized = replace(layer, **{attr: gptq_awq(lin.dense_weight().float(), h[POINT_OF[attr]], group_size,
                                                 clips.get(attr), inputs.cfg)
                                  for attr, lin in target.linears().items()})
    inputs.advance(quantized)
    return quantized


def quantization_config_for(cfg: QuantConfig) -> dict | None:
    if cfg.scheme == Scheme.INT8:
        return int8_quantization_config(static=cfg.act == ActQuant.STATIC)
    if cfg.scheme == Scheme.FP8:
        return fp8_quantization_config(static=cfg.act == ActQuant.STATIC)
    if cfg.scheme == Scheme.AWQ:
        return awq_quantization_config(cfg.group_size)
    return None
