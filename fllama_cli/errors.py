"""Turn library errors into one line and an exit code; FLLAMA_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

import os
from typing import Callable, NoReturn

from rich.console import Console
from rich.markup import escape
from typer import TyperException

from model_zoo.errors import FllamaError

err_console = Console(stderr=True, highlight=False)


def debug() -> bool:
    return os.environ.get("FLLAMA_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)  # paths may hold [brackets]
    raise SystemExit(code)


def warn(message: str) -> None:
    """A note that does not stop the command (an option that has no effect, a choice made for the user)."""
    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", soft_wrap=True)


def run_guarded(fn: Callable[[], object]) -> None:
    """Run the CLI; every user-caused error becomes `error: <one line>` with exit 1 (130 on Ctrl-C, 2 on a
    command line the parser rejects)."""
    try:
        code = fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        code = 130
    except TyperException as e:  # the parser's usage errors (typer's click): one line, not a panel
        if debug():
            raise
        usage_error(e)
    except Exception as e:  # noqa: BLE001 - the one place that maps every error to a line
        if debug():
            raise
        fail(describe(e))
    if code == 130:  # typer turns Ctrl-C into exit code 130
        err_console.print("interrupted")
    if isinstance(code, int) and code:
        raise SystemExit(code)


def usage_error(e: TyperException) -> NoReturn:
    message = e.format_message() if hasattr(e, "format_message") else str(e)
    code = getattr(e, "exit_code", 2)
    if not message:  # no_args_is_help: typer has printed the help already
        raise SystemExit(code)
    ctx = getattr(e, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    fail(message + hint, code)


def describe(e: BaseException) -> str:
    if isinstance(e, FllamaError):
        return str(e)
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "the GPU ran out of memory: use a smaller batch, --max-new-tokens or context, or a smaller model"
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e):  # torch's CPU allocator: a RuntimeError
        return "out of host memory: use a smaller batch, --bins, --samples or model"
    if isinstance(e, FileNotFoundError):
        return f"no such file or directory: {e.filename}"
    if isinstance(e, PermissionError):
        return f"permission denied: {e.filename}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} (set FLLAMA_DEBUG=1 for the traceback)"


