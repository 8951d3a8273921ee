"""Text a user types or pipes in (prompts, chat lines): read as UTF-8, refused in one line when it is not."""

from __future__ import annotations

import sys

from model_zoo.errors import PromptError


def as_text(data: str | bytes, where: str) -> str:
    """`data` as a str of valid UTF-8 text. Bytes that are not UTF-8 reach a str as lone surrogates (Python's
    surrogateescape for argv and some terminals), which no tokenizer accepts: both are refused here."""
    try:
        if isinstance(data, bytes):
            return data.decode("utf-8")
        data.encode("utf-8")  # raises on lone surrogates
        return data
    except UnicodeError as e:
        bad = data[e.start]
        byte = bad if isinstance(bad, int) else ord(bad) - 0xDC00 if 0xDC80 <= ord(bad) <= 0xDCFF else None
        what = f"byte 0x{byte:02x}" if byte is not None and 0 <= byte < 256 else "a character"
        raise PromptError(f"{where} is not UTF-8 text ({what} at position {e.start})") from None


def read_stdin() -> str:
    """All of standard input, decoded strictly as UTF-8."""
    buffer = getattr(sys.stdin, "buffer", None)
    return as_text(buffer.read() if buffer is not None else sys.stdin.read(), "standard input")


def read_stdin_line() -> str:
    """One line of standard input ('' at its end); PromptError if it is not UTF-8."""
    buffer = getattr(sys.stdin, "buffer", None)
    return as_text(buffer.readline() if buffer is not None else sys.stdin.readline(), "that line")


def read_prompt_arg(prompts: list[str] | None) -> list[str]:
    """-p values, or the whole of stdin when none is given and stdin is not a terminal."""
    if prompts:
        return [as_text(p, "the prompt" + (f" {i + 1}" if len(prompts) > 1 else "")) for i, p in enumerate(prompts)]
    if not sys.stdin.isatty():
        return [read_stdin()]
    return []
