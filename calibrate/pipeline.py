"""The calibrate and quantize pipelines end to end, each one function the CLI calls:
model source -> weights -> calibration windows -> layer-by-layer capture or quantization -> file on disk."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from calibrate.calibration import DataConfig, calibrate_model, calibration_windows
from calibrate.capture import CaptureConfig, capture_stats
from calibrate.export import checkpoint_bytes, write_checkpoint
from calibrate.methods import CalibConfig
from calibrate.outputs import OutputKind, check_free_space, prepare_output
from calibrate.quantize import (QuantConfig, awq_gptq_notes, quantization_config_for, quantize_awq, quantize_fp8,
                                quantize_int8)
from calibrate.stats import CalibStats, PointStats, fllama_version
from model_zoo.backend import check_token_ids
from model_zoo.errors import ConfigError, DeviceError
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme
from model_zoo.weights import ModelWeights

# progress(layer, n_layers, tokens): `tokens` more of `layer` captured; once with tokens=0 as the capture starts
CaptureProgress = Callable[[int, int, int], None]
# progress(stage, done, total): e.g. "quantize layers" 3 of 30, or "re-capture (smoothed)" in tokens
QuantizeProgress = Callable[[str, int, int], None]
# note(text): a choice made for the user or something found on the way (a stale temporary removed)
Notice = Callable[[str], None]
RECAPTURE = "re-capture (smoothed)"
DEVICES = ("auto", "cpu", "cuda")


def torch_device(choice: str) -> str:
    """Where torch work (capture, search) runs: the GPU when asked for or present; `choice` one of DEVICES."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA GPU visible to PyTorch")
    return "cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu"


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; devices: {', '.join(DEVICES)}")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value  # `value or default` would take --samples 0 for "not given"


def _notify(note: Notice | None, lines: list[str]) -> None:
    for line in lines:
        if note:
            note(line)


def capture_config(batch: int, device: str) -> CaptureConfig:
    # fp16 on the GPU halves the activations' traffic; the CPU has no fast fp16 matmul
    return CaptureConfig(batch=batch, device=device, dtype=torch.float16 if device == "cuda" else torch.float32)


@dataclass(frozen=True)
class CalibrateJob:
    model: str | None  # as load_model takes it: a directory, a .gguf, a hub id or a preset (with random)
    output: Path  # the stats file (safetensors)
    data: DataConfig
    calib: CalibConfig
    batch: int = 8  # windows per forward
    device: str = "auto"  # one of DEVICES
    random: bool = False
    seed: int = 0
    force: bool = False  # replace an existing output

    def __post_init__(self) -> None:
        _check_device(self.device)


def run_calibrate(job: CalibrateJob, progress: CaptureProgress | None = None,
                  note: Notice | None = None) -> CalibStats:
    """Capture activation statistics over the job's text and save them to job.output; returns them."""
    _notify(note, prepare_output(job.output, OutputKind.FILE, job.force))  # before the work, not after it
    dev = torch_device(job.device)  # capture runs in torch: a GPU helps even without the PyCUDA engine
    loaded = load_model(job.model, random=job.random, seed=job.seed)
    windows = _windows(loaded, job.data)  # [samples, seq_len]
    weights = build_weights(loaded, torch.float32, "cpu")  # stays on the host; layers visit the device
    cap = capture_config(job.batch, dev)
    n_layers = loaded.config.n_layers
    t0 = time.perf_counter()
    if progress:
        progress(0, n_layers, 0)
    on_tokens = (lambda layer, tokens: progress(layer, n_layers, tokens)) if progress else None
    stats = calibrate_model(weights, windows, job.data, job.calib, cap, loaded.source, on_tokens)
    stats.meta["seconds"] = round(time.perf_counter() - t0, 2)
    stats.meta["device"] = dev
    stats.save(job.output, force=job.force)
    return stats


@dataclass(frozen=True)
class QuantizeJob:
    model: str | None
    output: Path  # the checkpoint directory
    quant: QuantConfig
    stats: Path | None = None  # from run_calibrate: needed by static activations and SmoothQuant
    data: str | None = None  # calibration text source; default: the stats', else gutenberg:history
    samples: int | None = None  # default: the stats', else 128
    seq_len: int | None = None  # default: the stats', else 512
    batch: int = 8
    device: str = "auto"
    random: bool = False
    seed: int = 0
    force: bool = False

    def __post_init__(self) -> None:
        _check_device(self.device)
        if self.quant.needs_stats and self.stats is None:
            raise ConfigError("--act static and --smooth need calibration stats: run `fllama calibrate -o "
                              "stats.safetensors` and pass --stats stats.safetensors")
        if self.stats is not None and not self.quant.needs_stats:
            raise ConfigError("--stats is read by --scheme int8 / fp8 with --act static or --smooth only; it "
                              "does nothing here")
        given = [f"--{n.replace('_', '-')}" for n in ("data", "samples", "seq_len") if getattr(self, n) is not None]
        if given and not self.quant.reads_text:
            raise ConfigError(f"{', '.join(given)}: no calibration text is read here (only the AWQ search, fp8's "
                              "GPTQ rounding, scale search and --calibrator output, and --act static with --smooth "
                              "run the model on text)")


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    quant: QuantConfig
    bytes: int  # of the checkpoint's safetensors files
    seconds: float  # quantization and export, not loading
    device: str


def run_quantize(job: QuantizeJob, progress: QuantizeProgress | None = None,
                 note: Notice | None = None) -> QuantizeResult:
    """Quantize q, k, v, o, gate, up and down of job.model and write the checkpoint to job.output."""
    _notify(note, prepare_output(job.output, OutputKind.CHECKPOINT, job.force))  # fails now, not after the work
    loaded = load_model(job.model, random=job.random, seed=job.seed)
    if loaded.meta.get("quantization_config"):
        raise ConfigError(f"{loaded.source} is already quantized; quantize an unquantized model")
    quant, chosen = job.quant.with_group_size(loaded.config)
    job = replace(job, quant=quant)
    _notify(note, [chosen] if chosen else [])
    check_free_space(job.output, checkpoint_bytes(loaded.config, quant.scheme, quant.group_size))
    stats = CalibStats.load(job.stats) if job.stats is not None else None
    if stats is not None:
        stats.check_model(loaded.config, check_name=False)
    sm = stats.meta if stats is not None else {}
    # the windows default to the stats' own, so a re-capture sees the text the ranges came from; without stats,
    # 512 tokens or the model's whole context if shorter
    seq_len = _given(job.seq_len, sm.get("seq_len", min(512, loaded.config.max_positions)))
    data = DataConfig(source=_given(job.data, sm.get("source", "gutenberg:history")),
                      samples=_given(job.samples, sm.get("samples", 128)), seq_len=seq_len)
    _notify(note, awq_gptq_notes(quant, data.samples * seq_len))
    dev = torch_device(job.device)
    cap = capture_config(job.batch, dev)
    weights = build_weights(loaded, torch.float32, "cpu")
    t0 = time.perf_counter()
    qweights, report = _quantize(job, weights, loaded, stats, data, cap, progress)
    meta = checkpoint_meta(job, loaded.source, stats, data, report)
    write_checkpoint(job.output, qweights, loaded.tokenizer, quantization_config_for(job.quant), meta, force=job.force)
    size = sum(f.stat().st_size for f in job.output.glob("*.safetensors"))
    return QuantizeResult(job.output, job.quant, size, round(time.perf_counter() - t0, 2), dev)


def _quantize(job: QuantizeJob, weights: ModelWeights, loaded: Any, stats: CalibStats | None, data: DataConfig,
              cap: CaptureConfig, progress: QuantizeProgress | None) -> tuple[ModelWeights, dict]:
    """(quantized weights, the AWQ search's report or {}) for the job's scheme."""
    def layers_done(stage: str, i: int, n: int) -> None:
        if progress:
            progress(f"{stage} layers", i + 1, n)

    cfg = job.quant
    if cfg.scheme == Scheme.INT8:
        return quantize_int8(weights, cfg, stats, _recapturer(loaded, data, stats, cap, progress), layers_done), {}
    if cfg.scheme == Scheme.FP8:
        windows = _windows(loaded, data) if cfg.fp8_reads_inputs or cfg.output_ranges else None  # [samples, seq_len]
        recapture = _recapturer(loaded, data, stats, cap, progress)
        return quantize_fp8(weights, cfg, stats, recapture, layers_done, windows, cap), {}
    if cfg.scheme == Scheme.AWQ:
        windows = _windows(loaded, data) if cfg.reads_text else None  # [samples, seq_len]
        return quantize_awq(weights, cfg, windows, cap, progress=layers_done)
    return weights, {}


def _windows(loaded: Any, data: DataConfig) -> torch.Tensor:
    windows = calibration_windows(loaded.tokenizer, data, loaded.config.max_positions)  # [samples, seq_len]
    check_token_ids(windows, loaded.config.vocab_size, "the calibration text")
    return windows


def _recapturer(loaded: Any, data: DataConfig, stats: CalibStats | None, cap: CaptureConfig,
                progress: QuantizeProgress | None) -> Callable[[ModelWeights], dict[str, PointStats]]:
    """The stats describe the unsmoothed activations: after SmoothQuant, static ranges need the smoothed model's."""
    def recapture(smoothed: ModelWeights) -> dict[str, PointStats]:
        windows = _windows(loaded, data)  # [samples, seq_len]
        total, done = loaded.config.n_layers * windows.numel(), 0
        if progress:
            progress(RECAPTURE, 0, total)

        def advance(_layer: int, tokens: int) -> None:
            nonlocal done
            done += tokens
            if progress:
                progress(RECAPTURE, done, total)

        return capture_stats(smoothed, windows, stats.meta.get("bins", 2048), cap, advance)

    return recapture


def checkpoint_meta(job: QuantizeJob, source: str, stats: CalibStats | None, data: DataConfig,
                    report: dict) -> dict:
    """fllama_meta.json: how the checkpoint was made (the options, the stats, the calibration text)."""
    cfg, sm = job.quant, (stats.meta if stats is not None else {})
    used_text = cfg.reads_text
    meta = {**cfg.describe(), "source": source,
            "stats": {"path": str(job.stats), "source": sm.get("source"), "samples": sm.get("samples"),
                      "seq_len": sm.get("seq_len"), "model": sm.get("model")} if stats else None,
            "calibration_data": asdict(data) if used_text else None,
            "fllama_version": fllama_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if report:
        meta["awq_search"] = report
    return meta
