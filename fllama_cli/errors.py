"""Turn library errors into one line and an exit code; FLLAMA_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

import os
from typing import Callable, NoReturn

from rich.console import Console

from model_zoo.errors import FllamaError

err_console = Console(stderr=True, highlight=False)


def debug() -> bool:
    return os.environ.get("FLLAMA_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = 1) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise SystemExit(code)


def run_guarded(fn: Callable[[], object]) -> None:
    """Run the CLI; every user-caused error becomes `error: <one line>` with exit 1 (130 on Ctrl-C)."""
    try:
        fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug():
            raise
        err_console.print("interrupted")
        raise SystemExit(130)
    except Exception as e:  # noqa: BLE001 - the one place that maps every error to a line
        if debug():
            raise
        fail(describe(e))


def describe(e: BaseException) -> str:
    if isinstance(e, FllamaError):
        return str(e)
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "the GPU ran out of memory: use a smaller batch, --max-new-tokens or context, or a smaller model"
    if isinstance(e, MemoryError):
        return "out of host memory"
    if isinstance(e, FileNotFoundError):
        return f"no such file or directory: {e.filename}"
    if isinstance(e, PermissionError):
        return f"permission denied: {e.filename}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first} (set FLLAMA_DEBUG=1 for the traceback)"


