"""`fllama chat`: a multi-turn conversation in the terminal with the model's chat template."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from fllama_cli.options import KvInt8Opt, LmHeadInt8Opt, DeviceChoice, DeviceOpt, ModelArg, RandomOpt, SeedOpt
from fllama_cli.runtime import open_model
from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig
from model_zoo.sampling import SamplingConfig

HELP = "Commands: /reset starts over, /exit (or Ctrl-D) quits."


def chat_cmd(
    model: ModelArg = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per reply at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.7,
    top_k: Annotated[int, typer.Option("--top-k")] = 40,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty")] = 1.1,
    context: Annotated[int, typer.Option("--context", help="KV-cache positions for the conversation.")] = 4096,
    seed: SeedOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    kv_int8: KvInt8Opt = False,
    lm_head_int8: LmHeadInt8Opt = False,
    random: RandomOpt = False,
) -> None:
    """Chat with a model; the KV cache is kept between turns, so each turn only prefills what is new."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens,
                           sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                                                   repetition_penalty=repetition_penalty, seed=seed))
    opened = open_model(model, device=device, random=random, seed=seed, kv_int8=kv_int8, lm_head_int8=lm_head_int8)
    session = ChatSession(opened.backend, opened.tokenizer, cfg, system=system, max_len=context)
    out = Console(highlight=False, soft_wrap=True)
    interactive = sys.stdin.isatty()
    if interactive:
        out.print(f"[dim]{opened.loaded.source} · {opened.describe()} · {HELP}[/]")
    while True:
        try:
            line = out.input("[bold green]> [/]") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            session.reset()
            out.print("[dim](conversation reset)[/]")
            continue
        if line.startswith("/"):
            out.print(f"[dim]unknown command {line.split()[0]}. {HELP}[/]")
            continue
        _, stats = session.send(line, on_text=lambda _r, t: (sys.stdout.write(t), sys.stdout.flush()))
        print()
        if interactive:
            out.print(f"[dim]{stats.generated_tokens} tokens · {stats.tokens_per_s:.1f} tok/s · "
                      f"{session.cache.lengths[0].item()} in cache[/]")
