"""One sequence's generated tokens as text: streaming decode, end-of-sequence, stop strings and the token budget.

Shared by the generation loop and the server's scheduler, so both end a sequence on the same token and show the
same text. Tokens arrive one at a time (a step or two after the device made them); a token after the end is never
pushed, so nothing past a stop is shown or counted.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# on_text(text): called with each complete piece of text as it is generated
OnText = Callable[[str], None]


class TextStream:
    """tokens: the generated ids (the end-of-sequence id not included; a stop string's tokens included, its text
    cut); text: what has been decoded so far; finish_reason: None while open, then "eos" | "stop" | "length"."""

    def __init__(self, tokenizer: Any, budget: int, stop_strings: Sequence[str] = (), stop_at_eos: bool = True,
                 on_text: OnText | None = None):
        if budget < 1:
            raise ValueError(f"a token budget must be >= 1, got {budget}")
        self.budget, self.stop_strings, self.on_text = budget, tuple(stop_strings), on_text
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.decoder = tokenizer.stream_decoder()
        self.eos_ids = tokenizer.eos_ids if stop_at_eos else frozenset()
        self.emitted = 0  # characters of self.text already handed to on_text
        # a tail that could be the start of a stop string is held back, so it is never shown and then cut
        self._hold = max((len(s) - 1 for s in self.stop_strings), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        """Tokens the model produced for this sequence, the end-of-sequence id included (usage counts)."""
        return len(self.tokens) + (self.finish_reason == "eos")

    def push(self, token: int) -> bool:
        """Take the next token; True once the sequence has ended (then push no more)."""
        if self.finish_reason is not None:
            raise ValueError("push after the sequence ended")
        if token in self.eos_ids:
            self.finish_reason = "eos"
            self._emit(self.text + self.decoder.flush(), final=True)
            return True
        self.tokens.append(token)
        text = self.text + self.decoder.push(token)
        for stop in self.stop_strings:
            cut = text.find(stop, max(0, len(self.text) - len(stop) + 1))  # the text before held no stop
            if cut >= 0:
                self.finish_reason = "stop"
                self._emit(text[:cut], final=True)
                return True
        if len(self.tokens) >= self.budget:
            self.finish_reason = "length"
            self._emit(text + self.decoder.flush(), final=True)
            return True
        self._emit(text, final=False)
        return False

    def _emit(self, text: str, final: bool) -> None:
        self.text = text
        ready = len(text) - (0 if final else self._hold)
        if ready > self.emitted:
            if self.on_text is not None:
                self.on_text(text[self.emitted:ready])
            self.emitted = ready
