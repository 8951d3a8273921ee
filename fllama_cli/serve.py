"""`fllama serve`: an OpenAI-compatible HTTP server with continuous batching (docs/serving.md)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from fllama_cli.errors import warn
from fllama_cli.options import DeviceChoice, DeviceOpt, KvFp8Opt, KvInt8Opt, LmHeadInt8Opt, ModelArg, RandomOpt, SeedOpt, kv_kind
from fllama_cli.runtime import open_model
from model_zoo.errors import ConfigError
from model_zoo.load import DEFAULT_MODEL

SUMMARY = "Serve a model over HTTP, OpenAI-compatible, many requests batched together."
EXAMPLES = ("fllama serve ./smollm2-awq --max-batch 16",
            "fllama serve llama2-7b --random --max-batch 32 --max-context 1024 --port 8080",
            'curl -s localhost:8000/v1/chat/completions -H "Content-Type: application/json" '
            '-d \'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}\'')
DEFAULT_CONTEXT = 4096  # positions per slot when --max-context is not given (capped at the model's context)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_cmd(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; 0.0.0.0 listens on every interface "
                                                     "(then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port.")] = 8000,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, max=64, help="Requests decoded together: the KV "
                                           "cache holds this many slots of --max-context positions.")] = 8,
    max_context: Annotated[Optional[int], typer.Option("--max-context", metavar="<positions>", min=2, show_default=False,
                                                       help="Positions per slot (prompt + reply); the KV cache holds "
                                                            "--max-batch x this, checked against GPU memory at start "
                                                            f"\\[default: {DEFAULT_CONTEXT}, or the model's context "
                                                            "if smaller].")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests that may wait for a free slot; "
                                           "beyond it the server answers 429 with Retry-After.")] = 256,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", min=16, help="Prompt tokens prefilled between "
                                               "two decode steps at most: a long prompt is prefilled in chunks so "
                                               "the running requests keep streaming.")] = 512,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="FLLAMA_API_KEY", show_default=False,
                                                   help="Require `Authorization: Bearer <key>` on /v1/ requests "
                                                        "(or set FLLAMA_API_KEY).")] = None,
    served_name: Annotated[Optional[str], typer.Option("--served-model-name", show_default=False,
                                                       help="The model name clients send \\[default: MODEL as "
                                                            "given].")] = None,
    device: DeviceOpt = DeviceChoice.auto,
    kv_int8: KvInt8Opt = False,
    kv_fp8: KvFp8Opt = False,
    lm_head_int8: LmHeadInt8Opt = False,
    random: RandomOpt = False,
    scheme: Annotated[Optional[str], typer.Option("--scheme", show_default=False,
                                                  help="With --random on the GPU: the random weights' scheme (fp16, "
                                                       "int8, awq, fp8), made on the GPU as `fllama bench --random` "
                                                       "makes them. A checkpoint has its own.")] = None,
    seed: SeedOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="uvicorn's log and a line per request.")] = False,
) -> None:
    """Serve a model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models) plus /health
    and /metrics (Prometheus). Requests join the running batch as slots free up; each has its own sampling
    parameters. Ctrl-C stops the server."""
    from fllama_cli.server.app import ServeConfig
    from fllama_cli.server.runner import check_listen, serve
    from model_zoo.scheduler import SchedulerConfig

    check_listen(host, port)  # before the model loads
    kv = kv_kind(kv_int8, kv_fp8)
    if host not in LOOPBACK and not api_key:
        warn(f"listening on {host} without --api-key: anyone who reaches this port can use the model")
    if scheme is not None:
        if not random or device == DeviceChoice.cpu:
            raise ConfigError("--scheme chooses the scheme of --random weights on the GPU engine; a checkpoint has "
                              "its own")
        from fllama_cli.server.random_engine import open_random_engine

        opened = open_random_engine(model or DEFAULT_MODEL, scheme, seed=seed, kv=kv,
                                    lm_head_int8=lm_head_int8, max_context=max_context)
    else:
        opened = open_model(model, device=device, random=random, seed=seed, kv=kv,
                            lm_head_int8=lm_head_int8, max_context=max_context)
    context = max_context or min(DEFAULT_CONTEXT, opened.config.max_positions)
    name = served_name or model or DEFAULT_MODEL
    cfg = ServeConfig(model_name=name, host=host, port=port, api_key=api_key, verbose=verbose,
                      scheduler=SchedulerConfig(max_batch=max_batch, max_context=context, max_queue=max_queue,
                                                prefill_chunk=prefill_chunk))
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    serve(opened.backend, opened.tokenizer, cfg, announce=lambda: err.print(
        f"[dim]serving {escape(name)} on {url}/v1 · max-batch {max_batch} · max-context {context:,} · "
        f"{escape(opened.describe())} · Ctrl-C stops[/]"))
