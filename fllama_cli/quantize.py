"""`fllama quantize`: export a per-channel INT8 or FP8 (W8A8) or AWQ int4 checkpoint, layer by layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from calibrate.gptq_round import Rounding
from calibrate.fp8_scale import Fp8WeightScale
from calibrate.methods import CalibMethod
from calibrate.quantize import AwqMethod, QuantConfig
from fllama_cli.options import DeviceChoice, DeviceOpt, ForceOpt, JsonOpt, ModelArg, QuietOpt, RandomOpt, SeedOpt, WindowBatchOpt
from model_zoo.quant.formats import Scheme
from model_zoo.quant.int8 import ActQuant

SUMMARY = "Write an int8 or fp8 (W8A8) or AWQ int4 checkpoint that fllama, vLLM and transformers load."
EXAMPLES = ("fllama quantize --scheme awq -o smollm2-awq",
            "fllama quantize --scheme awq --group-size 32 --rounding nearest -o smollm2-awq-g32-nearest",
            "fllama quantize --scheme int8 --smooth 0.5 --stats stats.safetensors -o smollm2-int8",
            "fllama quantize --scheme int8 --act static --stats stats.safetensors -o smollm2-int8-static",
            "fllama quantize --scheme fp8 -o smollm2-fp8",
            "fllama quantize --scheme fp8 --rounding nearest --weight-scale max -o smollm2-fp8-rtn",
            "fllama quantize --scheme fp8 --act static --smooth 0.5 --stats stats.safetensors -o smollm2-fp8-static")


def quantize_cmd(
    model: ModelArg = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Output directory (refused if it exists, unless --force).", show_default=False)] = ...,
    scheme: Annotated[Scheme, typer.Option("--scheme", help="int8: W8A8 per-channel int8 weights; fp8: W8A8 float8 e4m3 (Hopper); awq: int4 weights in groups; fp16: plain export.")] = Scheme.INT8,
    stats: Annotated[Optional[Path], typer.Option("--stats", help="Calibration stats from `fllama calibrate` (needed by --act static and --smooth).")] = None,
    act: Annotated[ActQuant, typer.Option("--act", help="int8 / fp8 activations: dynamic per-token scales, or static per-tensor scales from --stats.")] = ActQuant.DYNAMIC,
    calibrator: Annotated[Optional[CalibMethod], typer.Option("--calibrator", help="Range method for --act static: max, percentile, mse or entropy read the --stats histograms; 'output' (fp8) chooses each range among theirs and a grid by the error it causes at the outputs of the linears reading it, their weights quantized, on the calibration text (--data) \\[default: mse for int8, max for fp8: docs/quality.md].", show_default=False)] = None,
    percentile: Annotated[Optional[float], typer.Option("--percentile", help="For --calibrator percentile \\[default: 99.99].", show_default=False)] = None,
    smooth: Annotated[Optional[float], typer.Option("--smooth", help="SmoothQuant alpha in [0, 1] (e.g. 0.5): move activation outliers into the weights.")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="awq: input channels per scale/zero group \\[default: the largest of 128, 64, 32 that divides every layer].", show_default=False)] = None,
    method: Annotated[Optional[AwqMethod], typer.Option("--method", help="awq: 'awq' searches scales and clips; 'rtn' is plain round-to-nearest \\[default: awq].", show_default=False)] = None,
    rounding: Annotated[Optional[Rounding], typer.Option("--rounding", help="fp8 and awq: how weights take grid values (e4m3 at each channel's scale; int4 at each group's step and zero point, which awq's search sets). 'gptq' rounds column by column and pushes each rounding error onto the columns not yet rounded, weighted by the calibration text's inputs (--data), so layer outputs move less; 'nearest' rounds each weight alone. The file format is the same either way \\[default: gptq; nearest for --method rtn].", show_default=False)] = None,
    weight_scale: Annotated[Optional[Fp8WeightScale], typer.Option("--weight-scale", help="fp8: each output channel's scale. 'search' tries 20 scales around amax / 448 (sliding e4m3's grid over the row, or clipping its largest weights) and keeps the one whose rounding moves the outputs least on the calibration text; 'max' is amax / 448. With --rounding nearest --weight-scale max no text is read \\[default: search].", show_default=False)] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Calibration text for the AWQ search, GPTQ rounding (fp8, awq), fp8's --calibrator output or re-capture (default: the stats' source, else gutenberg:history).")] = None,
    samples: Annotated[Optional[int], typer.Option("--samples", help="Windows of calibration text (default: the stats', else 128).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window (default: the stats', else 512 or the model's context if shorter).")] = None,
    batch: WindowBatchOpt = 8,
    device: DeviceOpt = DeviceChoice.auto,
    random: RandomOpt = False,
    seed: SeedOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Quantize q, k, v, o, gate, up and down (embeddings, norms and lm_head stay fp16) and write a checkpoint
    that fllama, vLLM and transformers load (compressed-tensors int8 or fp8, AutoAWQ GEMM). Options that do not apply to
    the scheme are refused."""
    from calibrate.pipeline import QuantizeJob, run_quantize

    cfg = QuantConfig(scheme=scheme, act=act, calibrator=calibrator, percentile=percentile, smooth=smooth,
                      group_size=group_size, awq_method=method, rounding=rounding,
                      weight_scale=weight_scale)
    job = QuantizeJob(model=model, output=output, quant=cfg, stats=stats, data=data, samples=samples, seq_len=seq_len,
                      batch=batch, device=device.value, random=random, seed=seed or 0, force=force)
    err = Console(stderr=True, highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=quiet or json_out or not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done)

        result = run_quantize(job, progress, note=lambda text: bar.console.print(f"[dim]{escape(text)}[/]"))
    described = result.quant.describe()
    summary = {"output": str(result.output), **described, "bytes": result.bytes, "seconds": result.seconds,
               "device": result.device}
    if json_out:
        print(json.dumps(summary))
    else:
        options = " ".join(f"{k}={v}" for k, v in described.items() if v is not None)
        err.print(f"wrote {escape(str(output))} · {escape(options)} · {result.bytes / 2**20:.1f} MiB · {result.seconds:.1f} s on "
                  f"{result.device}")
