"""`fllama calibrate`: activation statistics per capture point and ranges by max / percentile / MSE / entropy."""

from __future__ import annotations

import json
import sys
import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from calibrate.calibration import DataConfig, fit_seq_len, range_report
from calibrate.methods import CalibConfig, CalibMethod, parse_methods
from calibrate.stats import CalibStats
from fllama_cli.options import DeviceChoice, DeviceOpt, ForceOpt, JsonOpt, ModelArg, QuietOpt, RandomOpt, SeedOpt, WindowBatchOpt
from model_zoo.errors import ConfigError
from model_zoo.text_sources import SOURCES

SUMMARY = "Activation statistics per capture point, and ranges by max / percentile / MSE / entropy (int8 and fp8)."
EXAMPLES = ("fllama calibrate -o stats.safetensors",
            "fllama calibrate --data gutenberg:history --samples 128 --seq-len 512 -o stats.safetensors",
            "fllama calibrate --from-stats stats.safetensors --method mse")


def calibrate_cmd(
    model: ModelArg = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Text source \\[default: gutenberg:history]:\n" + SOURCES, show_default=False)] = None,
    samples: Annotated[Optional[int], typer.Option("--samples", help="Windows of --seq-len tokens to run \\[default: 128].", show_default=False)] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window, at most the model's context \\[default: 512, or the model's context if smaller].", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help="max | percentile | mse | entropy | all")] = "all",
    percentile: Annotated[Optional[float], typer.Option("--percentile", help="Percentile of |x| for the percentile method \\[default: 99.99].", show_default=False)] = None,
    bins: Annotated[Optional[int], typer.Option("--bins", help="Histogram bins (>= 128) \\[default: 2048].", show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the statistics here (safetensors). Required, unless --from-stats.")] = None,
    from_stats: Annotated[Optional[Path], typer.Option("--from-stats", help="Recompute ranges from a saved stats file; runs no model.")] = None,
    batch: WindowBatchOpt = 8,
    device: DeviceOpt = DeviceChoice.auto,
    random: RandomOpt = False,
    seed: SeedOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Run text through the model layer by layer, collect |x| histograms and per-channel statistics at the
    inputs of q/k/v, o_proj, gate/up and down_proj, and report each method's amax and SQNR on the int8 grid and
    on the fp8 e4m3 grid (MSE and entropy judge each grid's own rounding and saturation)."""
    err = Console(stderr=True, highlight=False)
    methods = parse_methods(method)
    if percentile is not None and methods not in (None, CalibMethod.PERCENTILE):
        raise ConfigError(f"--percentile applies to the percentile method; --method {method} does not use it")
    percentile = 99.99 if percentile is None else percentile
    if from_stats is not None:
        run_only = {"MODEL": model, "-o": output, "--data": data, "--samples": samples, "--seq-len": seq_len,
                    "--bins": bins, "--random": random or None, "--seed": seed, "--force": force or None}
        given = [name for name, value in run_only.items() if value is not None]
        if given:
            raise ConfigError(f"--from-stats recomputes ranges from a saved file and runs no model: drop "
                              f"{', '.join(given)}")
        stats = CalibStats.load(from_stats)
        calib = CalibConfig(method=methods, percentile=percentile, bins=stats.meta.get("bins", 2048),
                            start_bin=stats.calib_config.start_bin)
        _render(range_report(stats, calib), stats.meta, json_out)
        return
    samples = 128 if samples is None else samples
    calib = CalibConfig(method=methods, percentile=percentile, bins=2048 if bins is None else bins)
    data_cfg = DataConfig(source=data or "gutenberg:history", samples=samples, seq_len=seq_len)
    if output is None:
        raise ConfigError("give the output file: -o stats.safetensors")
    from calibrate.pipeline import CalibrateJob, run_calibrate
    from model_zoo.load import resolve_config

    job = CalibrateJob(model=model, output=output, data=data_cfg, calib=calib, batch=batch, device=device.value,
                       random=random, seed=seed or 0, force=force)
    with Progress(TextColumn("[bold]layer {task.fields[layer]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err,
                  disable=quiet or json_out or not err.is_terminal) as bar:
        started: dict = {}  # the bar and its clock start with the capture, after the model has loaded

        def progress(layer: int, n_layers: int, tokens: int) -> None:
            if not started:  # the model has loaded (and the output was checked): the window fits its context
                total = samples * fit_seq_len(seq_len, resolve_config(model).max_positions)
                started.update(t0=time.perf_counter(), task=bar.add_task("capture", total=n_layers * total,
                                                                        layer=f"0/{n_layers}", rate=""))
                return
            task = started["task"]
            bar.advance(task, tokens)
            done = bar.tasks[0].completed
            rate = done / max(time.perf_counter() - started["t0"], 1e-9)
            bar.update(task, layer=f"{layer + 1}/{n_layers}", rate=f"{rate:,.0f} tok/s")

        stats = run_calibrate(job, progress, note=lambda text: bar.console.print(f"[dim]{escape(text)}[/]"))
    dev = stats.meta["device"]
    if not json_out:
        err.print(f"[dim]wrote {escape(str(output))} ({len(stats.points)} capture points, {samples}x{stats.meta['seq_len']} tokens of {escape(data_cfg.source)}, "
                  f"{stats.meta['seconds']:.1f} s on {dev})[/]")
    _render(range_report(stats, calib), stats.meta, json_out)


def _render(report: dict, meta: dict, json_out: bool) -> None:
    if json_out:
        print(json.dumps(_finite(report)))
        return
    methods = list(next(iter(report.values())).keys())
    table = Table(title=f"activation ranges: amax / SQNR on the int8 and the fp8 (e4m3) grid · "
                        f"{escape(str(meta.get('model', {}).get('name', '?')))} · "
                        f"{escape(str(meta.get('source', '?')))} ({meta.get('samples', '?')}x{meta.get('seq_len', '?')})")
    table.add_column("capture point", no_wrap=True)
    for m in methods:
        table.add_column(f"{m} int8", justify="right", no_wrap=True)
        table.add_column(f"{m} fp8", justify="right", no_wrap=True)
    for point, row in report.items():
        cells = []
        for m in methods:
            cells += [_cell(row[m]), _cell(row[m]["fp8"])]
        table.add_row(point, *cells)
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)


def _cell(r: dict) -> str:
    return f"{r['amax']:.4g} / {r['sqnr_db']:.1f} dB"


def _finite(v):
    """JSON has no infinity: an exact (or empty) SQNR is written as null."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return None if isinstance(v, float) and math.isinf(v) else v
