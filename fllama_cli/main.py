"""The `fllama` application: wires one module per subcommand; errors become one line (see errors.py)."""

from __future__ import annotations

import typer
from typer.core import TyperCommand, TyperGroup

from fllama_cli import __version__
from fllama_cli.errors import run_guarded


def _flags_read_as_flags(command, ctx) -> None:
    """typer shows every option's type, `<bool>` for an on/off flag too, as if it took a value: flags (and
    --help) get none."""
    for param in [*command.params, command.get_help_option(ctx)]:
        if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


class Command(TyperCommand):
    def format_help(self, ctx, formatter) -> None:
        _flags_read_as_flags(self, ctx)
        super().format_help(ctx, formatter)


class Group(TyperGroup):
    def format_help(self, ctx, formatter) -> None:
        _flags_read_as_flags(self, ctx)
        super().format_help(ctx, formatter)


app = typer.Typer(
    name="fllama",
    cls=Group,
    help="Quantize LLaMA-family models (per-channel INT8, AWQ int4) and run them fast on NVIDIA GPUs.",
    epilog="[bold]Start here[/]\n\n  fllama generate -p \"The capital of France is\" -n 16 --temperature 0\n\n"
           "  fllama quantize --scheme awq -o smollm2-awq && fllama chat smollm2-awq",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _epilog(examples: tuple[str, ...]) -> str:
    return "[bold]Examples[/]\n\n" + "\n\n".join(f"  {e}" for e in examples)


def _register() -> None:
    from fllama_cli import bench, calibrate, chat, eval, generate, info, quantize, serve

    for name, module, fn in (("calibrate", calibrate, calibrate.calibrate_cmd),
                             ("quantize", quantize, quantize.quantize_cmd),
                             ("generate", generate, generate.generate_cmd), ("chat", chat, chat.chat_cmd),
                             ("bench", bench, bench.bench_cmd), ("eval", eval, eval.eval_cmd),
                             ("info", info, info.info_cmd), ("serve", serve, serve.serve_cmd)):
        app.command(name, cls=Command, short_help=module.SUMMARY, epilog=_epilog(module.EXAMPLES))(fn)


def _version(value: bool) -> None:
    if value:
        print(f"fllama {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """fllama: calibrate -> quantize -> generate / chat / eval / bench."""


_register()


def main() -> None:
    run_guarded(lambda: app(standalone_mode=False))  # errors are rendered by run_guarded, one line each


if __name__ == "__main__":
    main()
