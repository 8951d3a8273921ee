"""`fllama quantize`: export a per-channel INT8 (W8A8) or AWQ int4 checkpoint, layer by layer."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from calibrate.int8 import ActQuant
from calibrate.methods import CalibMethod
from calibrate.quantize import AwqMethod, QuantConfig
from fllama_cli.options import DeviceChoice, DeviceOpt, ForceOpt, JsonOpt, ModelArg, QuietOpt, RandomOpt, SeedOpt, WindowBatchOpt
from model_zoo.errors import ConfigError, FllamaError
from model_zoo.formats import Scheme


def quantize_cmd(
    model: ModelArg = None,
    scheme: Annotated[Scheme, typer.Option("--scheme", help="int8: W8A8 per-channel weights; awq: int4 weights in groups; fp16: plain export.")] = Scheme.INT8,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).")] = None,
    stats: Annotated[Optional[Path], typer.Option("--stats", help="Calibration stats from `fllama calibrate` (needed by --act static and --smooth).")] = None,
    act: Annotated[ActQuant, typer.Option("--act", help="int8 activations: dynamic per-token scales, or static per-tensor scales from --stats.")] = ActQuant.DYNAMIC,
    calibrator: Annotated[CalibMethod, typer.Option("--calibrator", help="Range method for --act static.")] = CalibMethod.PERCENTILE,
    percentile: Annotated[float, typer.Option("--percentile", help="For --calibrator percentile.")] = 99.99,
    smooth: Annotated[Optional[float], typer.Option("--smooth", help="SmoothQuant alpha in [0, 1] (e.g. 0.5): move activation outliers into the weights.")] = None,
    group_size: Annotated[int, typer.Option("--group-size", help="awq: input channels per scale/zero group.")] = 128,
    method: Annotated[AwqMethod, typer.Option("--method", help="awq: 'awq' searches scales and clips; 'rtn' is plain round-to-nearest.")] = AwqMethod.AWQ,
    data: Annotated[Optional[str], typer.Option("--data", help="Calibration text for the AWQ search or re-capture (default: the stats' source, else gutenberg:history).")] = None,
    samples: Annotated[Optional[int], typer.Option("--samples", help="Windows of calibration text (default: the stats', else 128).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window (default: the stats', else 512).")] = None,
    batch: WindowBatchOpt = 8,
    device: DeviceOpt = DeviceChoice.auto,
    random: RandomOpt = False,
    seed: SeedOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Quantize q, k, v, o, gate, up and down (embeddings, norms and lm_head stay fp16) and write a checkpoint
    that fllama, vLLM and transformers load (compressed-tensors int8, AutoAWQ GEMM)."""
    from calibrate.calibration import DataConfig, calibration_windows
    from calibrate.capture import CaptureConfig, capture_stats
    from calibrate.export import write_checkpoint
    from calibrate.quantize import quantization_config_for, quantize_awq, quantize_int8
    from calibrate.stats import CalibStats
    from fllama_cli.runtime import build_weights, torch_device
    from model_zoo.load import load_model

    if output is None:
        raise ConfigError("give the output directory: -o OUTDIR")
    if output.exists() and not force:
        raise FllamaError(f"{output} already exists; use --force to replace it")
    cfg = QuantConfig(scheme=scheme, act=act, calibrator=calibrator, percentile=percentile, smooth=smooth,
                      group_size=group_size, awq_method=method)
    if cfg.needs_stats and stats is None:
        raise ConfigError("--act static and --smooth need calibration stats: run `fllama calibrate -o stats.safetensors` "
                          "and pass --stats stats.safetensors")
    loaded = load_model(model, random=random, seed=seed or 0)
    if loaded.meta.get("quantization_config"):
        raise ConfigError(f"{loaded.source} is already quantized; quantize an unquantized model")
    calib_stats = CalibStats.load(stats) if stats is not None else None
    if calib_stats is not None:
        calib_stats.check_model(loaded.config, check_name=False)
    sm = calib_stats.meta if calib_stats is not None else {}
    data_cfg = DataConfig(source=data or sm.get("source", "gutenberg:history"),
                          samples=samples or sm.get("samples", 128), seq_len=seq_len or sm.get("seq_len", 512))
    dev = torch_device(device)
    cap = CaptureConfig(batch=batch, device=dev, dtype=torch.float16 if dev == "cuda" else torch.float32)
    weights = build_weights(loaded, torch.float32, "cpu")
    err = Console(stderr=True, highlight=False)
    t0 = time.perf_counter()
    report: dict = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=quiet or json_out or not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, i: int, n: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(f"{stage} layers", total=n)
            bar.update(tasks[stage], completed=i + 1)

        def recapture(smoothed):
            windows = calibration_windows(loaded.tokenizer, data_cfg, loaded.config.max_positions)
            task = bar.add_task("re-capture (smoothed)", total=loaded.config.n_layers * windows.numel())
            return capture_stats(smoothed, windows, sm.get("bins", 2048), cap,
                                 lambda layer, t: bar.advance(task, t))

        if scheme == Scheme.INT8:
            qweights = quantize_int8(weights, cfg, calib_stats, recapture, progress)
        elif scheme == Scheme.AWQ:
            windows = (calibration_windows(loaded.tokenizer, data_cfg, loaded.config.max_positions)
                       if method == AwqMethod.AWQ else None)
            qweights, report = quantize_awq(weights, cfg, windows, cap, progress=progress)
        else:
            qweights = weights
    fl_meta = {**cfg.describe(), "source": loaded.source,
               "stats": {"path": str(stats), "source": sm.get("source"), "samples": sm.get("samples"),
                         "seq_len": sm.get("seq_len"), "model": sm.get("model")} if calib_stats else None,
               "calibration_data": data_cfg.__dict__ if (scheme == Scheme.AWQ and method == AwqMethod.AWQ)
               or (cfg.smooth is not None and act == ActQuant.STATIC) else None,
               "fllama_version": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if report:
        fl_meta["awq_search"] = report
    write_checkpoint(output, qweights, loaded.tokenizer, quantization_config_for(cfg), fl_meta, force=force)
    size = sum(f.stat().st_size for f in output.glob("*.safetensors"))
    summary = {"output": str(output), **cfg.describe(), "bytes": size, "seconds": round(time.perf_counter() - t0, 2),
               "device": dev}
    if json_out:
        print(json.dumps(summary))
    else:
        err.print(f"wrote {output} · {cfg.describe()} · {size / 2**20:.1f} MiB · {summary['seconds']:.1f} s on {dev}")


def _version() -> str:
    from calibrate.stats import fllama_version

    return fllama_version()
