"""Decode steps queued ahead of the host: the loop launches step n+1 (and n+2 ...) before it reads step n's tokens,
so detokenizing, stop strings and streaming overlap the device's work instead of stalling it.

A pipe drives the decode steps of one KV cache. Rows join it with their first input token (sampled from their
prefill) and leave it when the loop decides they are done; a step decodes every joined row and samples its next
token, which is also the row's next input. Because results come back late, a row may decode a step or two past
its end: the loop ignores those tokens and sets the row's cache length back with `set_length`.

The GPU engine provides its own pipe (`Engine.decode_pipe`: graph replays, tokens copied back asynchronously);
every other backend gets `StepPipe`, which computes each step when it is launched.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from model_zoo.errors import PromptError


class PendingStep(Protocol):
    rows: tuple[int, ...]  # the cache rows that decoded in this step, in the order of tokens()

    def tokens(self) -> list[int]:
        """The sampled id of each row in `rows` (waits for the step to finish)."""
        ...


class DecodePipe(Protocol):
    depth: int  # steps a loop should keep in flight

    @property
    def rows(self) -> tuple[int, ...]:
        """The rows the next launch decodes."""
        ...

    def join(self, row: int, token: int, length: int) -> None:
        """Row decodes from the next launch on: its input `token`, its cache holding `length` positions."""
        ...

    def leave(self, row: int) -> None:
        """Row stops decoding from the next launch on (steps already launched still decode it)."""
        ...

    def set_length(self, row: int, length: int) -> None:
        """The row's cache holds `length` positions, after every step launched so far."""
        ...

    def launch(self) -> PendingStep:
        """Queue one decode step of the joined rows."""
        ...


class DoneStep:
    """A step whose tokens are already on the host."""

    def __init__(self, rows: Sequence[int], tokens: list[int]):
        self.rows, self._tokens = tuple(rows), tokens

    def tokens(self) -> list[int]:
        return self._tokens


class StepPipe:
    """The pipe of any backend: each launch runs the step at once (forward, then the sampler; or the backend's
    fused decode_sampled). The sampler's rows are the cache's rows."""

    depth = 1

    def __init__(self, backend: Any, cache: Any, sampler: Any):
        self.backend, self.cache, self.sampler = backend, cache, sampler
        self._inputs: dict[int, int] = {}  # row -> its next input id
        self._lengths: dict[int, int] = {}  # row -> positions its cache holds

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sorted(self._inputs))

    def join(self, row: int, token: int, length: int) -> None:
        self._inputs[row], self._lengths[row] = token, length

    def leave(self, row: int) -> None:
        self._inputs.pop(row, None)

    def set_length(self, row: int, length: int) -> None:
        self.cache.lengths[row] = length
        if row in self._lengths:
            self._lengths[row] = length

    def launch(self) -> PendingStep:
        rows = self.rows
        if not rows:
            raise ValueError("no row has joined the decode pipe")
        check_room(rows, self._lengths, self.cache.max_len)
        dev = self.backend.device
        last = torch.tensor([self._inputs[r] for r in rows], device=dev)  # [b]
        fused = getattr(self.backend, "decode_sampled", None)
        if fused is not None:  # the backend decodes and samples in one step
            nxt = fused(last, self.cache, list(rows), self.sampler)
        else:
            logits = self.backend.forward(last[:, None], self.cache, torch.tensor(rows, device=dev))[:, -1]  # [b, V]
            nxt = self.sampler.sample(logits, list(rows))
        toks = nxt.tolist()
        for r, t in zip(rows, toks):
            self._inputs[r] = t
            self._lengths[r] += 1
        return DoneStep(rows, toks)


def check_room(rows: Sequence[int], lengths: dict[int, int], capacity: int) -> None:
    """PromptError if a row's cache is full: a decode step writes one more position."""
    for r in rows:
        if lengths[r] + 1 > capacity:
            raise PromptError(f"the KV cache holds {capacity} positions; row {r} is full")


def open_pipe(backend: Any, cache: Any, sampler: Any) -> DecodePipe:
    """The backend's own pipe when it has one (the GPU engine), else a StepPipe."""
    factory = getattr(backend, "decode_pipe", None)
    return factory(cache, sampler) if factory is not None else StepPipe(backend, cache, sampler)
