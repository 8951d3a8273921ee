"""`fllama generate`: complete one prompt (streamed) or a batch of prompts."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fllama_cli.options import CpuDtypeOpt, KvFp8Opt, KvInt8Opt, LmHeadInt8Opt, MaxContextOpt, DeviceChoice, DeviceOpt, JsonOpt, ModelArg, RandomOpt, SeedOpt, kv_kind
from fllama_cli.prompts import read_prompt_arg
from fllama_cli.runtime import open_model
from fllama_cli.sampling import RepetitionOpt, TemperatureOpt, TopKOpt, TopPOpt, sampling_config
from model_zoo.errors import PromptError
from model_zoo.generation import GenerationConfig, check_prompts, generate
from model_zoo.warm_up import warm_up

SUMMARY = "Continue a prompt, streamed as it is generated (several -p: a batch)."
EXAMPLES = ('fllama generate -p "The capital of France is" -n 16 --temperature 0',
            'echo "Once upon a time" | fllama generate ./smollm2-awq -n 64 --seed 1',
            'fllama generate -p "short" -p "a longer second prompt" --json')


def generate_cmd(
    model: ModelArg = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", metavar="<str>", help="Prompt text; repeat for a batch. Read from stdin when absent.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")] = 128,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    repetition_penalty: RepetitionOpt = 1.0,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", metavar="<str>", help="Stop when this text appears (repeatable).")] = None,
    seed: SeedOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    kv_int8: KvInt8Opt = False,
    kv_fp8: KvFp8Opt = False,
    lm_head_int8: LmHeadInt8Opt = False,
    cpu_dtype: CpuDtypeOpt = None,
    max_context: MaxContextOpt = None,
    random: RandomOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Generate a continuation of a prompt, streamed as it comes (several -p: a batch)."""
    prompts = read_prompt_arg(prompt)
    if not prompts or not any(p.strip() for p in prompts):
        raise PromptError("the prompt is empty: give -p TEXT or pipe text on stdin")
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, stop_strings=tuple(stop or ()),
                           sampling=sampling_config(temperature, top_k, top_p, repetition_penalty, seed))
    opened = open_model(model, device=device, random=random, seed=seed, kv=kv_kind(kv_int8, kv_fp8),
                        lm_head_int8=lm_head_int8, max_context=max_context, cpu_dtype=cpu_dtype)
    tok = opened.tokenizer
    ids = [tok.encode(p) for p in prompts]
    check_prompts(ids, opened.config)  # before the prompt is echoed: an error is one line, not the prompt and a line
    warm_s = warm_up(opened.backend, tok, ids, cfg)  # the GPU's kernels and decode graph, not in the stats below
    stream = not json_out and len(prompts) == 1
    out = Console(highlight=False, soft_wrap=True)
    if stream:
        out.print(prompts[0], end="", style="dim", markup=False)  # a prompt is text, not rich markup
    on_text = (lambda _row, text: (sys.stdout.write(text), sys.stdout.flush())) if stream else None
    results, stats = generate(opened.backend, tok, ids, cfg, on_text=on_text)
    if json_out:
        rows = [{"text": r.text, "tokens": r.tokens, "prompt_tokens": r.prompt_tokens,
                 "generated_tokens": len(r.tokens), "finish_reason": r.finish_reason} for r in results]
        summary = {"tokens_per_s": round(stats.tokens_per_s, 3),
                   "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
                   "time_to_first_token_s": round(stats.prefill_s, 4), "warm_up_s": round(warm_s, 4),
                   "device": opened.device,
                   "backend": opened.backend.name}
        obj = {**rows[0], **summary} if len(rows) == 1 else {"results": rows, **summary,
                                                             "generated_tokens": sum(len(r.tokens) for r in results)}
        print(json.dumps(obj))
        return
    if not stream:
        for p, r in zip(prompts, results):
            out.print(f"[dim]{escape(p)}[/]{escape(r.text)}")
            out.rule(style="dim")
    else:
        print()
    err = Console(stderr=True, highlight=False)
    err.print(f"[dim]{stats.generated_tokens} tokens · {stats.tokens_per_s:.1f} tok/s decode · "
              f"prefill {stats.prompt_tokens} tokens in {stats.prefill_s:.2f} s · {opened.describe()}[/]")
    report = getattr(opened.backend, "memory_report", None)
    if report is not None:  # the GPU engine: where its memory went
        m = report()
        kv = sum(m["kv_cache_bytes"].values())
        err.print(f"[dim]GPU memory: weights {m['weights_bytes'] / 2**20:,.0f} MiB · KV cache {kv / 2**20:,.0f} MiB · "
                  f"peak {m['peak_bytes'] / 2**20:,.0f} MiB[/]")
