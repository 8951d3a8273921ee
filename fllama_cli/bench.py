"""`fllama bench`: prefill / decode throughput, latency and memory against the bandwidth floor and a torch baseline."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from calibrate.outputs import OutputKind, prepare_output
from fllama_cli.options import ForceOpt, JsonOpt, ModelArg, RandomOpt, SeedOpt, kv_kind
from fllama_cli.runtime import build_kernels
from fllama_cli.sampling import TopKOpt, TopPOpt, sampling_config
from model_zoo.errors import ConfigError

SUMMARY = "GPU engine throughput, latency and memory against the bandwidth floor and torch.compile."
EXAMPLES = ("fllama bench --random --model llama2-7b --scheme fp16,awq --batch 1,8",
            "fllama bench ./smollm2-awq --scheme awq --batch 1 --json")


class Baseline(str, Enum):
    torch = "torch"
    none = "none"


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def bench_cmd(
    model: ModelArg = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", help="Same as MODEL (e.g. llama2-7b with --random).")] = None,
    scheme: Annotated[str, typer.Option("--scheme", help="Comma-separated: fp16,int8,awq,fp8 (random weights are quantized on the GPU; fp8 needs compute capability 8.9+).")] = "fp16,int8,awq",
    batch: Annotated[str, typer.Option("--batch", help="Comma-separated batch sizes (1..64).")] = "1,8,32",
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Prompt tokens per row (prefill).")] = 512,
    gen_len: Annotated[int, typer.Option("--gen-len", help="Decode steps timed per repeat.")] = 128,
    baseline: Annotated[Baseline, typer.Option("--baseline", help="torch: the reference model in fp16 under torch.compile with CUDA graphs.")] = Baseline.torch,
    repeat: Annotated[int, typer.Option("--repeat", help="Repeats (medians and p90 are over them).")] = 3,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="AWQ group size of --random weights with --scheme awq \\[default: 128].", show_default=False)] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the table as Markdown to this file (an existing one only with --force).")] = None,
    pdl: Annotated[Optional[bool], typer.Option("--pdl/--no-pdl", help="Programmatic dependent launch on Hopper (each kernel starts while the previous one finishes; on unless FLLAMA_PDL=0); --no-pdl to compare.")] = None,
    fold_norms: Annotated[bool, typer.Option("--fold-norms/--no-fold-norms", help="Small-batch decode (fp16 up to 8 rows, awq up to 4, int8 up to 16): RMSNorms deferred into the GEMVs around them instead of kernels of their own; --no-fold-norms to compare.")] = True,
    fuse_rope: Annotated[bool, typer.Option("--fuse-rope/--no-fuse-rope", help="Decode: RoPE and the new token's K/V cache write inside the attention kernel instead of a kernel of their own; --no-fuse-rope to compare.")] = True,
    kv_int8: Annotated[bool, typer.Option("--kv-int8", help="The engine's int8 KV cache (as generate / chat --kv-int8): half the cache bytes each decode step reads; the floor counts them. The baseline keeps fp16.")] = False,
    kv_fp8: Annotated[bool, typer.Option("--kv-fp8", help="The engine's FP8 (E4M3) KV cache (as generate / chat --kv-fp8; compute capability 8.9+): the bytes of --kv-int8. The baseline keeps fp16.")] = False,
    lm_head_int8: Annotated[bool, typer.Option("--lm-head-int8", help="The int8 and awq engines' lm_head as int8 codes with a scale per vocabulary row (as generate / chat / eval --lm-head-int8): half its bytes each decode step; the floor counts them. fp16 (the unquantized model) and the baseline keep the fp16 head.")] = False,
    temperature: Annotated[float, typer.Option("--temperature", help="Sample the engine's decode steps and generation loop as generate does (0: greedy, the default; the baseline stays greedy), e.g. --temperature 0.7 for generate's defaults top-k 40, top-p 0.95.")] = 0.0,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    loop: Annotated[bool, typer.Option("--loop/--no-loop", help="Batch 1 also through the generation loop that generate and chat run (prefill, decode run ahead of the host, detokenized and stop-checked): the decode tok/s a user gets, and its ratio to the engine's.")] = True,
    random: RandomOpt = False,
    seed: SeedOpt = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure the GPU engine: copy bandwidth, then per scheme and batch size prefill tokens/s, time to first
    token, decode tokens/s, ms per token (median, p90), effective GB/s and % of the measured bandwidth, peak
    memory, the generation loop's decode tokens/s at batch 1, and the same shapes under torch.compile as the
    baseline.

    Example: fllama bench --model llama2-7b --random --scheme fp16,awq --batch 1,8"""
    from kernels_cu.bench import BenchConfig
    from kernels_cu.bench_suite import BenchRequest, run_bench

    kv = kv_kind(kv_int8, kv_fp8)
    if markdown is not None:  # an unwritable path fails now, not after the benchmark
        for note in prepare_output(markdown, OutputKind.FILE, force):
            Console(stderr=True, highlight=False).print(f"[dim]{escape(note)}[/]")
    schemes = tuple(s.strip() for s in scheme.split(",") if s.strip())
    if group_size is not None and not (random and "awq" in schemes):
        raise ConfigError("--group-size sets the AWQ groups of --random weights with --scheme awq; a checkpoint "
                          "keeps its own")
    req = BenchRequest(source=model_opt or model, schemes=schemes,
                       cfg=BenchConfig(batches=_ints(batch, "--batch"), prompt_len=prompt_len, gen_len=gen_len,
                                       repeat=repeat, group_size=128 if group_size is None else group_size,
                                       sampling=sampling_config(temperature, top_k, top_p, 1.0, seed)),
                       baseline=baseline == Baseline.torch, random=random, seed=seed or 0, pdl=pdl,
                       fold_norms=fold_norms, fuse_rope=fuse_rope, kv=kv, lm_head_int8=lm_head_int8, loop=loop)
    build_kernels()
    err = Console(stderr=True, highlight=False)
    rows, meta = run_bench(req, lambda msg: err.print(f"[dim]{escape(msg)}[/]"))
    if json_out:
        print(json.dumps({"meta": meta, "rows": rows}, default=float))
    else:
        Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(_table(rows, meta))
    if markdown is not None:
        markdown.write_text(_markdown(rows, meta))


COLUMNS = [("scheme", "scheme", "{}"), ("batch", "batch", "{}"), ("prefill_tok_s", "prefill tok/s", "{:,.0f}"),
           ("ttft_ms", "TTFT ms", "{:.1f}"), ("ttft_eager_ms", "TTFT new shape ms", "{:.1f}"), ("decode_tok_s", "decode tok/s", "{:,.1f}"),
           ("generate_tok_s", "generate tok/s", "{:,.1f}"),
           ("generate_vs_engine", "generate / decode", "{:.3f}"), ("ms_per_step_median", "ms/step p50", "{:.3f}"), ("ms_per_step_p90", "p90", "{:.3f}"),
           ("effective_gb_s", "GB/s", "{:,.0f}"), ("pct_of_bandwidth", "% of copy bw", "{:.1f}"),
           ("floor_tok_s", "floor tok/s", "{:,.0f}"), ("speedup_decode", "x torch.compile decode", "{:.2f}"),
           ("speedup_prefill", "x prefill", "{:.2f}"), ("peak_gpu_bytes", "peak GiB", "{}")]


def _cells(r: dict) -> list[str]:
    out = []
    for key, _, fmt in COLUMNS:
        v = r.get(key)
        if v is None:
            out.append("-")
        elif key == "peak_gpu_bytes":
            out.append(f"{v / 2**30:.1f}")
        else:
            out.append(fmt.format(v))
    return out


def _options(meta: dict) -> str:
    """The header's note of the engine options that change what a step reads."""
    kv = meta.get("kv_cache", "fp16")
    sampling = meta.get("sampling", "greedy")
    return (f" · KV cache {kv}" if kv != "fp16" else "") + (
        " · lm_head int8 (int8, awq)" if meta.get("lm_head_int8") else "") + (
        f" · sampling {sampling} (the baseline greedy)" if sampling != "greedy" else "")


def _table(rows: list[dict], meta: dict) -> Table:
    t = Table(title=f"fllama bench · {escape(str(meta['model']))} · {meta['gpu']} · driver {meta['driver']} · {meta['date']} · "
                    f"copy {meta['copy_bandwidth_tb_s']:.2f} TB/s · prompt {meta['prompt_len']} gen {meta['gen_len']} · "
                    f"PDL {'on' if meta['programmatic_launch'] else 'off'}{_options(meta)}")
    for _, title, _ in COLUMNS:
        t.add_column(title, justify="right")
    for r in rows:
        t.add_row(*_cells(r))
    return t


def _markdown(rows: list[dict], meta: dict) -> str:
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |\n"
    head += "|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(_cells(r)) + " |\n" for r in rows)
    base = "".join(f"| {b} | {v['prefill_tok_s']:,.0f} | {v['decode_tok_s']:,.1f} | {v['decode_ms_median']:.3f} | "
                   f"{v.get('compile_s', 0):.0f} |\n" for b, v in meta["baseline"].items())
    return (f"{meta['model']} · {meta['gpu']} · driver {meta['driver']} · {meta['date']} · copy bandwidth "
            f"{meta['copy_bandwidth_tb_s']:.2f} TB/s · prompt {meta['prompt_len']} · gen {meta['gen_len']} · "
            f"repeat {meta['repeat']} · programmatic launch {'on' if meta['programmatic_launch'] else 'off'}"
            f"{_options(meta)}\n\n" + head + body +
            ("\nBaseline (torch.compile, mode=reduce-overhead, fp16):\n\n| batch | prefill tok/s | decode tok/s | "
             "ms/step | compile s |\n|---|---|---|---|---|\n" + base if base else ""))
