"""OpenAI's response objects: chat.completion, text_completion and their streamed chunks as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from model_zoo.ticket import Ticket

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
FINGERPRINT = "fp_fllama"


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")


def usage(ticket: Ticket) -> dict:
    u = ticket.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


@dataclass
class Reply:
    """The objects of one request's answer, chat or completion."""

    chat: bool
    model: str
    include_usage: bool = False  # streaming: a last chunk with the usage (stream_options.include_usage)
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def whole(self, ticket: Ticket) -> dict:
        """The non-streamed answer."""
        reason = FINISH.get(ticket.finish_reason or "", "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": ticket.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": ticket.text, "logprobs": None, "finish_reason": reason}
        return {**self._head(False), "choices": [choice], "usage": usage(ticket)}

    def _chunk(self, text: str | None, reason: str | None, first: bool = False) -> str:
        if self.chat:
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return sse(obj)

    def opening(self) -> str:
        """Chat streams open with the assistant's role (an empty content), as OpenAI's do; completions don't."""
        return self._chunk("", None, first=True) if self.chat else ""

    def piece(self, text: str) -> str:
        return self._chunk(text, None)

    def closing(self, ticket: Ticket) -> str:
        """The last chunk (finish_reason), the usage chunk when asked for, and [DONE]."""
        out = self._chunk(None, FINISH.get(ticket.finish_reason or "", "stop"))
        if self.include_usage:
            out += sse({**self._head(True), "choices": [], "usage": usage(ticket)})
        return out + DONE

    @staticmethod
    def failure(status: int, message: str) -> str:
        """An error after the stream began (its status is sent already): an error event, then [DONE]."""
        return sse({"error": {"message": message, "type": "server_error", "param": None, "code": status}}) + DONE
