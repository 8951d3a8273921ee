"""Running the app under uvicorn: `serve` blocks until Ctrl-C (the command); `start_server` runs it in a thread
and returns once it listens (the tests, and the load test's --random server)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import uvicorn

from fllama_cli.server.app import ServeConfig, ServerState, create_app
from model_zoo.errors import ConfigError, DeviceError


def _uvicorn(state: ServerState) -> uvicorn.Server:
    cfg = state.cfg
    config = uvicorn.Config(create_app(state), host=cfg.host, port=cfg.port, http="h11", lifespan="on",
                            log_level="info" if cfg.verbose else "warning", access_log=cfg.verbose,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def check_listen(host: str, port: int) -> None:
    """ConfigError now, before a model loads, when host:port cannot be listened on (in use, not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(addr)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(backend: Any, tokenizer: Any, cfg: ServeConfig, announce: Callable[[], None] | None = None) -> None:
    """Serve until interrupted. The KV cache is allocated first, so a batch x context that does not fit is one
    error line before anything listens; then announce() (the command's line saying where it listens)."""
    server = _uvicorn(ServerState(backend, tokenizer, cfg))
    if announce is not None:
        announce()
    server.run()
    if not server.started:
        raise DeviceError(f"could not listen on {cfg.host}:{cfg.port} (in use, or not an address of this machine)")


class RunningServer:
    """A server in a thread of this process: `url`, `state`, `stop()`."""

    def __init__(self, backend: Any, tokenizer: Any, cfg: ServeConfig, timeout: float = 30.0):
        self.state = ServerState(backend, tokenizer, cfg)
        self.server = _uvicorn(self.state)
        self.thread = threading.Thread(target=self.server.run, name="fllama-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise DeviceError(f"the server did not start on {cfg.host}:{cfg.port}")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]  # the one chosen for port 0
        self.url = f"http://{cfg.host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.scheduler.close()

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(backend: Any, tokenizer: Any, cfg: ServeConfig) -> RunningServer:
    return RunningServer(backend, tokenizer, cfg)
