"""OpenAI's request bodies for /v1/chat/completions and /v1/completions (the fields fllama reads), and their
translation into a GenRequest. Unknown fields are ignored, as OpenAI-compatible servers do; fields that would
change the answer in a way fllama does not implement are refused with a 400 that names them."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from model_zoo.sampling import SamplingConfig
from model_zoo.ticket import GenRequest

SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
MAX_STOPS = 16


class BadRequest(Exception):
    """A request the server refuses with 400 (OpenAI's invalid_request_error)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)  # extra field (vLLM's): 0 or -1 = off
    repetition_penalty: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)  # extra field
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(1, ge=1)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = False  # extra field (vLLM's): generate max_tokens whatever the model says (benchmarks)

    def _refuse_unsupported(self) -> None:
        if (self.n or 1) != 1:
            raise BadRequest("n must be 1: fllama returns one choice per request", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported: use repetition_penalty (an extra field)", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise BadRequest(f"at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise BadRequest("a stop string is empty", "stop")
        return tuple(stops)

    def sampling(self) -> SamplingConfig:
        """OpenAI's defaults (temperature 1, top_p 1), no top-k unless asked."""
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return SamplingConfig(temperature=1.0 if self.temperature is None else self.temperature, top_k=top_k,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              seed=None if self.seed is None else self.seed & SEED_MASK)

    def gen_request(self, prompt: list[int], max_tokens: int | None) -> GenRequest:
        self._refuse_unsupported()
        return GenRequest(tuple(prompt), max_tokens, self.sampling(), self.stops(), stop_at_eos=not self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def as_template_input(self, index: int) -> dict[str, Any]:
        """{"role", "content"} with the content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            kinds = {p.type for p in content} - {"text"}
            if kinds:
                raise BadRequest(f"messages[{index}]: content parts of type {sorted(kinds)} are not supported "
                                 "(text only)", f"messages[{index}].content")
            content = "".join(p.text or "" for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise BadRequest("messages must hold at least one message", "messages")
        if self.logprobs:
            raise BadRequest("logprobs is not supported", "logprobs")
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadRequest("response_format other than text is not supported", "response_format")
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        """One prompt: text (encoded with the model's BOS rule) or token ids."""
        for name, bad in (("echo", self.echo), ("suffix", self.suffix), ("logprobs", self.logprobs is not None),
                          ("best_of", self.best_of not in (None, 1))):
            if bad:
                raise BadRequest(f"{name} is not supported", name)
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            return tokenizer.encode(p)
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return list(p)
        raise BadRequest("one prompt per request (a string or a list of token ids)", "prompt")
