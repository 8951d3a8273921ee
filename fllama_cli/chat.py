"""`fllama chat`: a multi-turn conversation in the terminal with the model's chat template."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fllama_cli.options import CpuDtypeOpt, KvFp8Opt, KvInt8Opt, LmHeadInt8Opt, DeviceChoice, DeviceOpt, ModelArg, RandomOpt, SeedOpt, kv_kind
from fllama_cli.prompts import as_text, read_stdin_line
from fllama_cli.runtime import open_model
from fllama_cli.sampling import RepetitionOpt, TemperatureOpt, TopKOpt, TopPOpt, sampling_config
from model_zoo.chat import DEFAULT_CONTEXT, ChatReply, ChatSession
from model_zoo.errors import FllamaError
from model_zoo.generation import GenerationConfig

SUMMARY = "Chat with a model; the KV cache is kept between turns."
EXAMPLES = ('fllama chat --system "You are concise." --temperature 0.3',
            'fllama chat ./smollm2-awq --context 2048',
            'printf "hello\\nand again\\n" | fllama chat -n 32 --temperature 0      # one turn per line')
HELP = "Commands: /reset starts over, /exit (or Ctrl-D) quits; Ctrl-C stops a reply."


def chat_cmd(
    model: ModelArg = None,
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per reply at most.")] = 256,
    temperature: TemperatureOpt = 0.7,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    repetition_penalty: RepetitionOpt = 1.1,
    context: Annotated[Optional[int], typer.Option("--context", help=f"KV-cache positions for the conversation, up to the model's context "
                                                                     f"\\[default: {DEFAULT_CONTEXT}, or the model's context if smaller]. "
                                                                     "A longer conversation drops its oldest turns.", show_default=False)] = None,
    seed: SeedOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    kv_int8: KvInt8Opt = False,
    kv_fp8: KvFp8Opt = False,
    lm_head_int8: LmHeadInt8Opt = False,
    cpu_dtype: CpuDtypeOpt = None,
    random: RandomOpt = False,
) -> None:
    """Chat with a model; the KV cache is kept between turns, so each turn only prefills what is new. When the
    conversation outgrows --context, its oldest turns are dropped (the system prompt stays)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens,
                           sampling=sampling_config(temperature, top_k, top_p, repetition_penalty, seed))
    opened = open_model(model, device=device, random=random, seed=seed, kv=kv_kind(kv_int8, kv_fp8),
                        lm_head_int8=lm_head_int8, cpu_dtype=cpu_dtype)
    session = ChatSession(opened.backend, opened.tokenizer, cfg, system=system, max_len=context)
    session.warm_up()  # the GPU's kernels and decode graph now, not in the first reply
    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    interactive = sys.stdin.isatty()
    if interactive:
        out.print(f"[dim]{escape(str(opened.loaded.source))} · {opened.describe()} · context {session.max_len} · {HELP}[/]")
    interrupts = 0  # Ctrl-C at the prompt twice in a row quits
    while True:
        try:
            line = as_text(out.input("[bold green]> [/]"), "that line") if interactive else read_stdin_line()
        except EOFError:
            break
        except KeyboardInterrupt:
            if not interactive or interrupts:
                raise
            interrupts += 1
            out.print("\n[dim](Ctrl-C again, Ctrl-D or /exit quits)[/]")
            continue
        except FllamaError as e:  # a line that is not UTF-8: refused, the conversation goes on
            err.print(f"[bold red]error:[/] {escape(str(e))}")
            continue
        interrupts = 0
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
            out.print(f"[dim]unknown command {escape(line.split()[0])}. {HELP}[/]")
            continue
        _turn(session, line, out, err, interactive)


def _turn(session: ChatSession, line: str, out: Console, err: Console, interactive: bool) -> None:
    """One user turn; errors and Ctrl-C end the turn, never the session."""
    try:
        reply = session.send(line, on_text=lambda _r, t: (sys.stdout.write(t), sys.stdout.flush()))
    except KeyboardInterrupt:
        if not interactive:
            raise
        print()
        out.print("[dim](reply stopped)[/]")
        return
    except FllamaError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return
    print()
    for note in _notes(reply, session):
        err.print(f"[dim]({escape(note)})[/]")
    if interactive:
        out.print(f"[dim]{reply.stats.generated_tokens} tokens · {reply.stats.tokens_per_s:.1f} tok/s · "
                  f"{session.cache.lengths[0].item()} of {session.max_len} in cache[/]")


def _notes(reply: ChatReply, session: ChatSession) -> list[str]:
    notes = []
    if reply.dropped_turns:
        notes.append(f"the conversation outgrew the context of {session.max_len} tokens: the oldest "
                     f"{'turn was' if reply.dropped_turns == 1 else f'{reply.dropped_turns} turns were'} dropped; "
                     "/reset starts over")
    if reply.context_full:
        notes.append(f"the reply stopped at the end of the context ({session.max_len} tokens)")
    return notes
