"""Calibration end to end: text -> windows -> layer-by-layer capture -> CalibStats, and the range report (each
method's range and its error on the int8 and the fp8 e4m3 grids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calibrate.capture import CaptureConfig, Progress, capture_stats
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from calibrate.ranges import compute_amax, scale_from_amax, sqnr_db_from_hist
from calibrate.stats import CalibStats, make_meta
from model_zoo.errors import ConfigError, TextSourceError
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import ModelWeights


DEFAULT_SEQ_LEN = 512  # tokens per window, or the model's whole context where that is shorter


@dataclass(frozen=True)
class DataConfig:
    source: str = "gutenberg:history"
    samples: int = 128
    seq_len: int | None = None  # None: fit_seq_len's default for the model

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"samples must be >= 1, got {self.samples}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ConfigError(f"seq-len must be >= 2, got {self.seq_len}")


def fit_seq_len(seq_len: int | None, max_positions: int) -> int:
    """Tokens per window for a model of `max_positions`: None gives DEFAULT_SEQ_LEN or the whole context if
    shorter; a window is one forward pass, so a longer one is refused (in eval's words, check_window_fits)."""
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, max_positions)
    if seq_len > max_positions:
        raise ConfigError(f"--seq-len {seq_len} is beyond the model's context of {max_positions} tokens: "
                          f"use --seq-len {max_positions} or less")
    return seq_len


def calibration_windows(tokenizer, data: DataConfig, max_positions: int) -> torch.Tensor:
    """[samples, seq_len] consecutive windows from the start of the text (seq_len: fit_seq_len's); errors when
    the text is too short."""
    seq_len = fit_seq_len(data.seq_len, max_positions)
    ids = tokenizer.encode(load_text(data.source))
    need = data.samples * seq_len
    if len(ids) < need:
        raise TextSourceError(f"{data.source} has {len(ids)} tokens; {data.samples} samples of {seq_len} "
                              f"need {need}: lower --samples or --seq-len")
    return token_windows(ids, seq_len, need)  # [samples, seq_len]


def calibrate_model(weights: ModelWeights, windows: torch.Tensor, data: DataConfig, calib: CalibConfig,
                    capture: CaptureConfig, source_name: str, progress: Progress | None = None) -> CalibStats:
    """windows [samples, seq_len] from calibration_windows(tokenizer, data, ...)."""
    points = capture_stats(weights, windows, calib.bins, capture, progress)
    meta = make_meta(weights.config, calib, source=data.source, samples=data.samples, seq_len=windows.shape[1],
                     tokens=windows.numel(), model_source=source_name)
    return CalibStats(points=points, meta=meta)


def range_report(stats: CalibStats, calib: CalibConfig) -> dict[str, dict[str, dict]]:
    """point -> method -> {"amax", "scale", "sqnr_db", "fp8": {"amax", "scale", "sqnr_db"}}: each method's range
    judged on int8's grid (top level) and on e4m3's (MSE and entropy choose differently there; max and percentile
    do not depend on the grid), with the SQNR that grid gives, computed over the histogram."""
    report: dict[str, dict[str, dict]] = {}
    for name, p in stats.points.items():
        row = {}
        for m in calib.methods:
            entry = {}
            for grid in QuantGrid:
                amax = p.amax if m is CalibMethod.MAX else compute_amax(m, p.hist, p.edges, calib, grid)
                entry[grid] = {"amax": amax, "scale": float(scale_from_amax(amax, grid)),
                               "sqnr_db": sqnr_db_from_hist(p.hist, p.edges, amax, grid)}
            row[m.value] = {**entry[QuantGrid.INT8], "fp8": entry[QuantGrid.FP8]}
        report[name] = row
    return report
