"""The `fllama` application: wires one module per subcommand; errors become one line (see errors.py)."""

from __future__ import annotations

import typer

from fllama_cli import __version__
from fllama_cli.errors import run_guarded

app = typer.Typer(
    name="fllama",
    help="Quantize LLaMA-family models (per-channel INT8, AWQ int4) and run them fast on NVIDIA GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    from fllama_cli.bench import bench_cmd
    from fllama_cli.calibrate import calibrate_cmd
    from fllama_cli.chat import chat_cmd
    from fllama_cli.eval import eval_cmd
    from fllama_cli.generate import generate_cmd
    from fllama_cli.info import info_cmd
    from fllama_cli.quantize import quantize_cmd

    app.command("calibrate")(calibrate_cmd)
    app.command("quantize")(quantize_cmd)
    app.command("generate")(generate_cmd)
    app.command("chat")(chat_cmd)
    app.command("bench")(bench_cmd)
    app.command("eval")(eval_cmd)
    app.command("info")(info_cmd)


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
    run_guarded(lambda: app(standalone_mode=True))


if __name__ == "__main__":
    main()
