"""A bounded load test of `fllama serve`: N concurrent streaming clients send a fixed number of completion requests
on localhost, then it stops and prints throughput, time to first token and inter-token latency percentiles.

    python -m tests.load_serve --url http://127.0.0.1:8000 --clients 32 --requests 128 --max-tokens 256
    python -m tests.load_serve --model llama2-7b --random --serve-args "--scheme awq --max-context 1024" \\
        --clients 32 --requests 128 --max-tokens 256 --json out.json

With --model it starts `fllama serve` in a child process (--max-batch = --clients unless --serve-args says) and
stops it at the end. Clients are threads on plain HTTP (http.client), in this process, never the server's. Each
request is a prompt of --prompt-len token ids with ignore_eos, so every request generates --max-tokens tokens.

Figures: `throughput` = generated tokens / wall time of the measured requests (prefills, queueing and ramps
included); `decode` = clients / mean TPOT, the decode rate the streams saw together, which is what `fllama bench`'s
decode tok/s at batch = clients measures; TTFT = request sent -> first text; TPOT = (last text - first text) /
(tokens - 1) per request; ITL = the gaps between a request's streamed chunks (a chunk carries the tokens that came
while the client was reading, usually one).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse


@dataclass
class Result:
    sent: float
    first: float | None = None
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stream_one(url: str, model: str, prompt: list[int], max_tokens: int, temperature: float, api_key: str | None,
               timeout: float) -> Result:
    u = urlparse(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    r = Result(sent=time.perf_counter())
    try:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
            return r
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                r.error = obj["error"].get("message", "error event")
                break
            if obj.get("usage"):
                r.tokens = obj["usage"]["completion_tokens"]
            if obj.get("choices") and obj["choices"][0].get("text"):
                r.first = r.first or now
                r.chunks.append(now)
    except (OSError, http.client.HTTPException, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return r


def run_load(url: str, model: str, clients: int, requests: int, max_tokens: int | Callable[[int], int],
             prompt_len: int = 32, temperature: float = 0.0, api_key: str | None = None,
             timeout: float = 600.0) -> tuple[list[Result], float]:
    """`requests` requests over `clients` threads, each sending its next request when the previous one ends:
    (results, wall seconds). max_tokens: a number, or request index -> number."""
    lock, results, next_i = threading.Lock(), [], [0]

    def client(c: int) -> None:
        while True:
            with lock:
                i = next_i[0]
                if i >= requests:
                    return
                next_i[0] += 1
            prompt = [3 + (i * 7919 + j * 104729) % 250 for j in range(prompt_len)]  # ids valid in any vocabulary
            n = max_tokens(i) if callable(max_tokens) else max_tokens
            res = stream_one(url, model, prompt, n, temperature, api_key, timeout)
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall: float, clients: int) -> dict:
    ok = [r for r in results if r.error is None and r.first is not None]
    ttft = [r.first - r.sent for r in ok]
    # a request whose tokens all came in one chunk (the server was faster than the client's reads) shows no time
    # between tokens: it counts for TTFT and throughput, not for TPOT
    tpot = [(r.chunks[-1] - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1 and len(r.chunks) > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tokens = sum(r.tokens for r in ok)
    ms = lambda xs, p: round(percentile(xs, p) * 1e3, 2)  # noqa: E731
    mean_tpot = sum(tpot) / len(tpot) if tpot else float("nan")
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
            "first_error": next((r.error for r in results if r.error), None), "generated_tokens": tokens,
            "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
            "decode_tok_s": round(clients / mean_tpot, 1) if tpot and mean_tpot > 0 else 0.0,
            **{f"ttft_p{p}_ms": ms(ttft, p) for p in (50, 90, 99)},
            **{f"tpot_p{p}_ms": ms(tpot, p) for p in (50, 90, 99)},
            **{f"itl_p{p}_ms": ms(itl, p) for p in (50, 90, 99)}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    u, deadline = urlparse(url), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no healthy server at {url} after {timeout:.0f} s")


def start_child(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    extra = shlex.split(args.serve_args)
    cmd = [sys.executable, "-m", "fllama_cli.main", "serve", args.model, "--port", str(port)]
    cmd += ["--random"] if args.random else []
    cmd += [] if "--max-batch" in extra else ["--max-batch", str(args.clients)]
    print("+", " ".join(shlex.quote(c) for c in cmd + extra), file=sys.stderr)
    proc = subprocess.Popen(cmd + extra, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"http://127.0.0.1:{port}"


def model_name(url: str, api_key: str | None) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="A running server (else --model starts one).")
    ap.add_argument("--model", help="Start `fllama serve MODEL` for the test (with --random, --serve-args).")
    ap.add_argument("--random", action="store_true", help="The started server uses random weights.")
    ap.add_argument("--serve-args", default="", help='More options for the started server, e.g. "--scheme awq".')
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="Requests measured, over all clients.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32, help="Prompt tokens per request.")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=None, help="Short requests first, not measured (graph captures); "
                                                             "default: one per client.")
    ap.add_argument("--api-key", default=os.environ.get("FLLAMA_API_KEY"))
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds for the whole measured run.")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="Seconds for a started server to load.")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="Write the summary as JSON (to a file).")
    args = ap.parse_args(argv)
    if not args.url and not args.model:
        ap.error("give --url of a running server or --model to start one")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_child(args)
    try:
        wait_healthy(url, proc, args.start_timeout)
        name = model_name(url, args.api_key)
        warm = args.clients if args.warmup is None else args.warmup
        if warm:  # the later a request, the sooner it ends: the batch shrinks through every decode graph
            run_load(url, name, args.clients, warm, lambda i: 4 + 2 * (warm - i), args.prompt_len,
                     args.temperature, args.api_key, 300)
        results, wall = run_load(url, name, args.clients, args.requests, args.max_tokens, args.prompt_len,
                                 args.temperature, args.api_key, args.timeout)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary = {"model": name, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, **summarize(results, wall, args.clients)}
    print(render(summary))
    if args.json:
        text = json.dumps(summary, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return summary


def render(s: dict) -> str:
    lines = [f"{s['model']}: {s['clients']} clients, {s['requests']} requests x {s['max_tokens']} tokens "
             f"(prompt {s['prompt_len']}), {s['errors']} errors" + (f" (first: {s['first_error']})" if s['errors'] else ""),
             f"  throughput {s['throughput_tok_s']:,.1f} tok/s over {s['wall_s']:.2f} s · decode "
             f"{s['decode_tok_s']:,.1f} tok/s (clients / mean TPOT)"]
    for name in ("ttft", "tpot", "itl"):
        lines.append(f"  {name.upper():5s} p50 {s[f'{name}_p50_ms']:8.2f} ms · p90 {s[f'{name}_p90_ms']:8.2f} ms · "
                     f"p99 {s[f'{name}_p99_ms']:8.2f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["errors"] else 0)
