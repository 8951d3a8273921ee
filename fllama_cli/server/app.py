"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models over a Scheduler, with /health
and /metrics. The scheduler's thread wakes the waiting handlers through the event loop (one call per step for all
the requests that moved), and a request whose client goes away is cancelled, which frees its slot."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fllama_cli.server.errors import ApiError, as_api_error, error_response, install_handlers
from fllama_cli.server.metrics import CONTENT_TYPE, ServerMetrics
from fllama_cli.server.openai_format import Reply
from fllama_cli.server.schemas import ChatRequest, CompletionRequest
from model_zoo.chat_template import encode_chat
from model_zoo.scheduler import Scheduler, SchedulerConfig
from model_zoo.ticket import GenRequest, Ticket

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    verbose: bool = False  # uvicorn's info log and access log


def device_thread_hooks(backend: Any) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """(enter, exit) for the scheduler's thread on the GPU engine (kernels_cu.cuda_context.thread_hooks)."""
    if getattr(getattr(backend, "device", None), "type", "cpu") != "cuda" or not hasattr(backend, "decode_pipe"):
        return None
    from kernels_cu import cuda_context

    return cuda_context.thread_hooks()


class ClientGone(Exception):
    """The client closed the connection while its request was waiting."""


class ServerState:
    """What the handlers share: the scheduler, the metrics, and an asyncio.Event per open ticket."""

    def __init__(self, backend: Any, tokenizer: Any, cfg: ServeConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.metrics = ServerMetrics(cfg.scheduler.max_batch)
        self.scheduler = Scheduler(backend, tokenizer, cfg.scheduler, observer=self.metrics,
                                   on_progress=self._progress, thread_hooks=device_thread_hooks(backend))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiters: dict[Ticket, asyncio.Event] = {}
        self.started = int(time.time())

    def _progress(self, tickets: list[Ticket]) -> None:
        """From the scheduler's thread: wake the handlers of the tickets that moved."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, tickets)

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            ev = self.waiters.get(t)
            if ev is not None:
                ev.set()

    def check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise ApiError(400, f"the model {name!r} does not exist here: this server runs "
                                f"{self.cfg.model_name!r} (GET /v1/models)", "model", "model_not_found")

    def follow(self, request: GenRequest) -> "Follower":
        ticket = self.scheduler.submit(request)
        ev = self.waiters[ticket] = asyncio.Event()
        return Follower(self, ticket, ev)


class Follower:
    """A handler's view of its ticket: the next text as it comes; close() cancels an unfinished request."""

    def __init__(self, state: ServerState, ticket: Ticket, ev: asyncio.Event):
        self.state, self.ticket, self.ev = state, ticket, ev

    async def next(self, request: Request | None = None) -> tuple[str, bool]:
        """(new text, ended); with `request`, ClientGone when its client has disconnected meanwhile."""
        while True:
            self.ev.clear()
            text, done = self.ticket.take(0)
            if text or done:
                return text, done
            if request is None:
                await self.ev.wait()
                continue
            try:
                await asyncio.wait_for(self.ev.wait(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone() from None

    def close(self) -> None:
        if not self.ticket.done:
            self.ticket.cancel()
        self.state.waiters.pop(self.ticket, None)


async def answer(state: ServerState, gen: GenRequest, reply: Reply, stream: bool, request: Request) -> Response:
    """Run one request: the whole answer, or a stream of server-sent events once its first text is there (so a
    request that fails before generating gets its error status, not a broken stream)."""
    f = state.follow(gen)
    try:
        if not stream:
            done = False
            while not done:
                _, done = await f.next(request)
            f.close()
            return JSONResponse(reply.whole(_succeeded(f.ticket)))
        first = await f.next(request)
        if first[1]:
            _succeeded(f.ticket)  # failed before its first text: an error status
    except ClientGone:
        f.close()
        return Response(status_code=499)  # nobody reads it; the slot is free again
    except BaseException:
        f.close()
        raise
    return StreamingResponse(_events(f, reply, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _succeeded(ticket: Ticket) -> Ticket:
    if ticket.finish_reason == "error":
        raise as_api_error(ticket.error or RuntimeError("unknown failure"))
    if ticket.finish_reason == "cancelled":
        raise ApiError(503, "the server stopped this request (shutting down)", retry_after=5.0)
    return ticket


async def _events(f: Follower, reply: Reply, first: tuple[str, bool]) -> AsyncIterator[str]:
    """The stream; a client that disconnects cancels this generator (Starlette), and so its request."""
    try:
        yield reply.opening()
        text, done = first
        while True:
            if text:
                yield reply.piece(text)
            if done:
                break
            text, done = await f.next()
        if f.ticket.finish_reason in ("error", "cancelled"):
            err = as_api_error(f.ticket.error or RuntimeError("the request was stopped"))
            yield reply.failure(err.status, err.message)
        else:
            yield reply.closing(f.ticket)
    finally:
        f.close()


class ApiKeyGuard:
    """ASGI middleware: /v1/ requests need `Authorization: Bearer <key>` (a plain ASGI layer, so streamed
    responses and disconnects pass through untouched)."""

    def __init__(self, app: Any, key: str, on_reject: Any):
        self.app, self.expected, self.on_reject = app, f"Bearer {key}".encode(), on_reject

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.on_reject(401)
                response = error_response(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.close()

    app = FastAPI(title="fllama", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app, state.metrics.reject)
    cfg = state.cfg

    if cfg.api_key:
        app.add_middleware(ApiKeyGuard, key=cfg.api_key, on_reject=state.metrics.reject)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        state.check_model(body.model)
        prompt = encode_chat(state.tokenizer, body.template_messages())
        gen = body.gen_request(prompt, body.budget())
        return await answer(state, gen, Reply(True, cfg.model_name, body.include_usage), bool(body.stream), request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        gen = body.gen_request(body.prompt_ids(state.tokenizer), body.max_tokens)
        return await answer(state, gen, Reply(False, cfg.model_name, body.include_usage), bool(body.stream), request)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": state.started,
                                            "owned_by": "fllama", "max_model_len": cfg.scheduler.max_context}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.scheduler.alive
        body = {"status": "ok" if ok else "unavailable", "model": cfg.model_name, **state.scheduler.load()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
