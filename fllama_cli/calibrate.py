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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from calibrate.calibration import DataConfig, range_report
from calibrate.methods import CalibConfig, parse_methods
from calibrate.stats import CalibStats
from fllama_cli.options import DeviceChoice, DeviceOpt, ForceOpt, JsonOpt, ModelArg, QuietOpt, RandomOpt, SeedOpt, WindowBatchOpt
from model_zoo.errors import ConfigError, FllamaError
from model_zoo.text_sources import SOURCES


def calibrate_cmd(
    model: ModelArg = None,
    data: Annotated[str, typer.Option("--data", help="Text source:\n" + SOURCES)] = "gutenberg:history",
    samples: Annotated[int, typer.Option("--samples", help="Windows of --seq-len tokens to run.")] = 128,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 512,
    method: Annotated[str, typer.Option("--method", help="max | percentile | mse | entropy | all")] = "all",
    percentile: Annotated[float, typer.Option("--percentile", help="Percentile of |x| for the percentile method.")] = 99.99,
    bins: Annotated[int, typer.Option("--bins", help="Histogram bins (>= 128).")] = 2048,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the statistics here (safetensors).")] = None,
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
    inputs of q/k/v, o_proj, gate/up and down_proj, and report each method's amax and SQNR."""
    err = Console(stderr=True, highlight=False)
    if from_stats is not None:
        stats = CalibStats.load(from_stats)
        calib = CalibConfig(method=parse_methods(method), percentile=percentile,
                            bins=stats.meta.get("bins", bins), start_bin=stats.calib_config.start_bin)
        if output is not None:
            raise ConfigError("--from-stats reads a stats file; it writes none (drop -o)")
        _render(range_report(stats, calib), stats.meta, json_out)
        return
    calib = CalibConfig(method=parse_methods(method), percentile=percentile, bins=bins)
    data_cfg = DataConfig(source=data, samples=samples, seq_len=seq_len)
    if output is None:
        raise ConfigError("give the output file: -o stats.safetensors")
    if output.exists() and not force:
        raise FllamaError(f"{output} already exists; use --force to overwrite it")

    from calibrate.pipeline import CalibrateJob, run_calibrate

    job = CalibrateJob(model=model, output=output, data=data_cfg, calib=calib, batch=batch, device=device.value,
                       random=random, seed=seed or 0, force=force)
    total = samples * seq_len
    with Progress(TextColumn("[bold]layer {task.fields[layer]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err,
                  disable=quiet or json_out or not err.is_terminal) as bar:
        started: dict = {}  # the bar and its clock start with the capture, after the model has loaded

        def progress(layer: int, n_layers: int, tokens: int) -> None:
            if not started:
                started.update(t0=time.perf_counter(), task=bar.add_task("capture", total=n_layers * total,
                                                                        layer=f"0/{n_layers}", rate=""))
                return
            task = started["task"]
            bar.advance(task, tokens)
            done = bar.tasks[0].completed
            rate = done / max(time.perf_counter() - started["t0"], 1e-9)
            bar.update(task, layer=f"{layer + 1}/{n_layers}", rate=f"{rate:,.0f} tok/s")

        stats = run_calibrate(job, progress)
    dev = stats.meta["device"]
    if not json_out:
        err.print(f"[dim]wrote {output} ({len(stats.points)} capture points, {samples}x{seq_len} tokens of {data}, "
                  f"{stats.meta['seconds']:.1f} s on {dev})[/]")
    _render(range_report(stats, calib), stats.meta, json_out)


def _render(report: dict, meta: dict, json_out: bool) -> None:
    if json_out:
        clean = {p: {m: {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in r.items()}
                     for m, r in row.items()} for p, row in report.items()}
        print(json.dumps(clean))
        return
    methods = list(next(iter(report.values())).keys())
    table = Table(title=f"activation ranges (amax / SQNR of int8 fake-quant) · {meta.get('model', {}).get('name', '?')} · "
                        f"{meta.get('source', '?')} ({meta.get('samples', '?')}x{meta.get('seq_len', '?')})")
    table.add_column("capture point", no_wrap=True)
    for m in methods:
        table.add_column(m, justify="right", no_wrap=True)
    for point, row in report.items():
        table.add_row(point, *(f"{row[m]['amax']:.4g} / {row[m]['sqnr_db']:.1f} dB" for m in methods))
    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(table)
