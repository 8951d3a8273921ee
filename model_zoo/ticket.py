"""A request to the scheduler (model_zoo/scheduler.py) and the ticket its caller follows it by.

The scheduler's thread writes a ticket (text pieces, the end, the usage counts); any other thread reads it: `take`
waits for new text, and an asyncio server is woken through the scheduler's on_progress hook instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from model_zoo.errors import ConfigError, FllamaError
from model_zoo.sampling import SamplingConfig


class Overloaded(FllamaError):
    """The queue of waiting requests is full: try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(FllamaError):
    """The scheduler has stopped (shutting down, or its thread died): no request is taken."""


@dataclass(frozen=True)
class GenRequest:
    """prompt: token ids; max_tokens: None = as many as the context leaves."""

    prompt: tuple[int, ...]
    max_tokens: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("a stop string is empty: it would end every reply before its first token")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0


class Ticket:
    """One request's progress. finish_reason: None while running, then "eos" | "stop" | "length" (generation
    ended), "cancelled", or "error" (then `error` holds the exception)."""

    def __init__(self, number: int, request: GenRequest, scheduler: object):
        self.number, self.request, self._scheduler = number, request, scheduler
        self.usage = Usage(prompt_tokens=len(request.prompt))
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.tokens: list[int] = []
        self.text = ""
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.slot: int | None = None  # the cache row while it holds one
        self._pieces: list[str] = []
        self._cond = threading.Condition()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating (the client went away): the slot is freed at the scheduler's next step."""
        self._scheduler.cancel(self)

    def take(self, timeout: float | None = None) -> tuple[str, bool]:
        """(text generated since the last take, whether the request has ended); waits up to `timeout` seconds
        while there is neither (None: forever, 0: not at all)."""
        with self._cond:
            if not self._pieces and not self.done and timeout != 0:
                self._cond.wait_for(lambda: self._pieces or self.done, timeout)
            text = "".join(self._pieces)
            self._pieces.clear()
            return text, self.done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end; True if it came."""
        with self._cond:
            return self._cond.wait_for(lambda: self.done, timeout)

    # -- written by the scheduler's thread ------------------------------------------------------------------
    def _add_text(self, text: str) -> None:
        with self._cond:
            self._pieces.append(text)
            self._cond.notify_all()

    def _finish(self, reason: str, tokens: Sequence[int] = (), text: str = "", completion_tokens: int = 0,
                error: BaseException | None = None) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            self.tokens, self.text, self.error = list(tokens), text, error
            self.usage.completion_tokens = completion_tokens
            self.finish_reason = reason
            self._cond.notify_all()
