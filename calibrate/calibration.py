"""Calibration end to end: text -> windows -> layer-by-layer capture -> CalibStats, and the range report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibrate.capture import CaptureConfig, Progress, capture_stats
from calibrate.methods import CalibConfig, CalibMethod
from calibrate.ranges import compute_amax, sqnr_db_from_hist
from calibrate.stats import CalibStats, make_meta
from model_zoo.errors import ConfigError, TextSourceError
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import ModelWeights


@dataclass(frozen=True)
class DataConfig:
    source: str = "gutenberg:history"
    samples: int = 128
    seq_len: int = 512

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"samples must be >= 1, got {self.samples}")
        if self.seq_len < 2:
            raise ConfigError(f"seq-len must be >= 2, got {self.seq_len}")


def calibration_windows(tokenizer, data: DataConfig, max_positions: int) -> torch.Tensor:
    """[samples, seq_len] consecutive windows from the start of the text; errors when it is too short."""
    if data.seq_len > max_positions:
        raise ConfigError(f"seq-len {data.seq_len} is above the model's context of {max_positions}")
    ids = tokenizer.encode(load_text(data.source))
    need = data.samples * data.seq_len
    if len(ids) < need:
        raise TextSourceError(f"{data.source} has {len(ids)} tokens; {data.samples} samples of {data.seq_len} "
                              f"need {need}: lower --samples or --seq-len")
    return token_windows(ids, data.seq_len, need)  # [samples, seq_len]


def calibrate_model(weights: ModelWeights, windows: torch.Tensor, data: DataConfig, calib: CalibConfig,
                    capture: CaptureConfig, source_name: str, progress: Progress | None = None) -> CalibStats:
    """windows [samples, seq_len] from calibration_windows(tokenizer, data, ...)."""
    points = capture_stats(weights, windows, calib.bins, capture, progress)
    meta = make_meta(weights.config, calib, source=data.source, samples=data.samples, seq_len=data.seq_len,
                     tokens=windows.numel(), model_source=source_name)
    return CalibStats(points=points, meta=meta)


def range_report(stats: CalibStats, calib: CalibConfig) -> dict[str, dict[str, dict[str, float]]]:
    """point -> method -> {"amax", "scale", "sqnr_db"}; the SQNR of int8 fake-quantization with that amax,
    computed over the histogram (each |x| at its bin centre)."""
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name, p in stats.points.items():
        row = {}
        for m in calib.methods:
            amax = p.amax if m is CalibMethod.MAX else compute_amax(m, p.hist, p.edges, calib)
            row[m.value] = {"amax": amax, "scale": amax / 127.0, "sqnr_db": sqnr_db_from_hist(p.hist, p.edges, amax)}
        report[name] = row
    return report
