"""`fllama eval`: perplexity on a text, and KL / top-1 agreement against a baseline model."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fllama_cli.options import CpuDtypeOpt, KvFp8Opt, KvInt8Opt, LmHeadInt8Opt, DeviceChoice, DeviceOpt, JsonOpt, ModelArg, QuietOpt, RandomOpt, SeedOpt, kv_kind
from fllama_cli.runtime import open_model
from model_zoo.evaluation import EvalConfig, check_baseline, check_window_fits, evaluate
from model_zoo.text_sources import SOURCES_HELP, load_text, token_windows

SUMMARY = "Perplexity on a text; KL and top-1 agreement against a baseline."
EXAMPLES = ("fllama eval --data gutenberg:sherlock --seq-len 512 --max-tokens 4096",
            "fllama eval ./smollm2-int8 --baseline smollm2-135m --max-tokens 16384 --json")


def eval_cmd(
    model: ModelArg = None,
    data: Annotated[str, typer.Option("--data", help=SOURCES_HELP)] = "gutenberg:sherlock",
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per window (non-overlapping) \\[default: 512, or the model's context if smaller].", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Use the first N tokens of the text.")] = 4096,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="A second model with the same tokenizer (e.g. the unquantized one): report KL divergence and top-1 agreement against it. Loaded as it is (--random applies to MODEL only).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Windows per forward pass.")] = 1,
    device: DeviceOpt = DeviceChoice.auto,
    kv_int8: KvInt8Opt = False,
    kv_fp8: KvFp8Opt = False,
    lm_head_int8: LmHeadInt8Opt = False,
    cpu_dtype: CpuDtypeOpt = None,
    random: RandomOpt = False,
    seed: SeedOpt = None,
    quiet: QuietOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Perplexity over non-overlapping windows of --seq-len tokens, each scoring its tokens 2..L."""
    EvalConfig(seq_len=2 if seq_len is None else seq_len, max_tokens=max_tokens, batch=batch)  # before the model loads
    opened = open_model(model, device=device, random=random, seed=seed, kv=kv_kind(kv_int8, kv_fp8),
                        lm_head_int8=lm_head_int8, cpu_dtype=cpu_dtype)
    seq_len = min(512, opened.config.max_positions) if seq_len is None else seq_len
    cfg = EvalConfig(seq_len=seq_len, max_tokens=max_tokens, batch=batch)
    check_window_fits(seq_len, opened.config)
    text = load_text(data)
    # --random is the model's: the baseline is loaded as it is (a random baseline measures nothing)
    base = open_model(baseline, device=device, seed=seed, cpu_dtype=cpu_dtype) if baseline else None
    if base is not None:
        check_window_fits(seq_len, base.config, "the baseline")
        check_baseline(opened.config, opened.tokenizer, base.config, base.tokenizer, text)
    ids = opened.tokenizer.encode(text)  # the tokenizer's default special tokens
    windows = token_windows(ids, seq_len, max_tokens)  # [n, L]
    err = Console(stderr=True, highlight=False)
    settings = (f"data={data} seq_len={seq_len} stride={seq_len} windows={len(windows)} "
                f"scored={len(windows) * (seq_len - 1)} tokens (first of each window unscored) "
                f"bos={'yes' if ids and ids[0] == opened.tokenizer.bos_id else 'no'} {opened.describe()}")
    if not json_out:
        err.print(f"[dim]{escape(settings)}[/]")
    with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, disable=quiet or json_out or not err.is_terminal, transient=True) as bar:
        task = bar.add_task("eval", total=len(windows))
        result = evaluate(opened.backend, windows, cfg, base.backend if base else None,
                          progress=lambda n: bar.advance(task, n))
    if json_out:
        print(json.dumps({**result.as_dict(), "data": data, "max_tokens": max_tokens, "stride": seq_len,
                          "model": opened.loaded.source, "baseline": base.loaded.source if base else None,
                          "device": opened.device}))
        return
    table = Table(title=f"fllama eval · {escape(str(opened.loaded.source))}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("perplexity", f"{result.perplexity:.4f}")
    table.add_row("tokens scored", str(result.tokens))
    if base is not None:
        table.add_row("baseline perplexity", f"{result.baseline_perplexity:.4f}")
        table.add_row("KL divergence (nats/token)", f"{result.kl_divergence:.6f}")
        table.add_row("top-1 agreement", f"{100 * result.top1_agreement:.2f}%")
    Console(highlight=False).print(table)
