"""Where the generation loop's time goes beside the engine's (a lab probe, imported by no product code).

    python -m kernels_cu.lab.loop_probe loop [--model llama3.2-1b] [--scheme awq] [--gen-len 64] [--depths 2,3,4]
    python -m kernels_cu.lab.loop_probe ttft [--model ...] [--warm none,256,full]

`loop`: generate() at batch 1 (`--sampling`) against the engine's graph-replayed step: its decode time at each pipe
depth, called from torch's stream and from fllama's own (no caller-stream ordering around each launch), then the
host time of each part of its decode (opening the pipe, launches, their control copies and publish_ids, waits for
tokens, set_length; the rest is detokenizing and stop checks).
`ttft`: in a fresh process per warm-up setting, the first three requests' time to first token (prompt lengths
L, L + 1, L + 2: each a new prefill shape), so a per-process first-request cost shows apart from a per-shape one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from kernels_cu import build
from kernels_cu.bench import BenchConfig, bench_engine, copy_bandwidth, random_weights
from kernels_cu.engine import Engine, EngineConfig
from kernels_cu.engine import pipe as engine_pipe
from kernels_cu.engine.sampler import GpuRowSampler
from model_zoo import generation
from model_zoo.config import LlamaConfig
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from model_zoo.warm_up import warm_up


SAMPLING = {"greedy": SamplingConfig(temperature=0.0), "default": SamplingConfig(),
            "temperature": SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)}


def _engine(model: str, scheme: str, max_len: int) -> Engine:
    config = LlamaConfig.from_name(model)
    weights = random_weights(config, scheme, torch.device("cuda"), 0)
    return Engine(weights, EngineConfig(max_len=max_len, lm_head_int8=scheme != "fp16"))


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


class _Timed:
    """Wraps methods of a class so that each call's host seconds add up under a name."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            if self.sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1
        setattr(owner, attr, timed)


def _loop_ms(engine, tok, prompt, gcfg, runs: int, on_stream: bool) -> float:
    """Median decode ms of generate() over `runs` runs (after one that captures the graphs)."""
    ctx = torch.cuda.stream(build.torch_stream()) if on_stream else contextlib.nullcontext()
    with ctx:
        generate(engine, tok, [prompt], gcfg)
        return statistics.median(generate(engine, tok, [prompt], gcfg, on_text=lambda *_: None)[1].decode_s
                                 for _ in range(runs)) * 1e3


def probe_loop(args) -> list[dict]:
    cfg = BenchConfig(batches=(1,), prompt_len=args.prompt_len, gen_len=args.gen_len, repeat=5,
                      sampling=SAMPLING[args.sampling])
    engine = _engine(args.model, args.scheme, cfg.prompt_len + cfg.gen_len + 1)
    step = bench_engine(engine, 1, cfg, copy_bandwidth(torch.device("cuda")))
    tok = Tokenizer.byte_fallback(engine.config.vocab_size)
    gcfg = GenerationConfig(max_new_tokens=cfg.gen_len, sampling=cfg.sampling, stop_at_eos=False)
    prompt = _prompt(engine.config.vocab_size, cfg.prompt_len, 0)
    engine_ms = (cfg.gen_len - 1) * 1e3 / step["decode_tok_s"]
    rows, cfg0 = [], engine.cfg
    for depth in [int(d) for d in args.depths.split(",")]:
        engine.cfg = dataclasses.replace(engine.cfg, pipe_depth=depth)  # read by each new pipe
        for on_stream in (False, True):
            ms = _loop_ms(engine, tok, prompt, gcfg, args.runs, on_stream)
            rows.append({"depth": depth, "on_stream": on_stream, "engine_ms": round(engine_ms, 3),
                         "loop_decode_ms": round(ms, 3), "ratio": round(engine_ms / ms, 4)})
    engine.cfg = cfg0
    rows.append(_loop_parts(engine, tok, prompt, gcfg, args.runs, engine_ms))
    return rows


def _loop_parts(engine, tok, prompt, gcfg, runs: int, engine_ms: float) -> dict:
    generate(engine, tok, [prompt], gcfg)
    timed = _Timed()
    timed.wrap(engine_pipe.EnginePipe, "__init__", "open_pipe")
    timed.wrap(engine_pipe.EnginePipe, "launch", "launch")
    timed.wrap(engine_pipe.EnginePipe, "_send_control", "send_control")
    timed.wrap(engine_pipe.EnginePipe, "set_length", "set_length")
    timed.wrap(engine_pipe.GpuStep, "tokens", "tokens_wait")
    timed.wrap(engine_pipe, "publish_ids", "publish_ids")
    timed.wrap(torch.cuda.CUDAGraph, "replay", "graph_replay")
    decode_ms = statistics.median(generate(engine, tok, [prompt], gcfg, on_text=lambda *_: None)[1].decode_s
                                  for _ in range(runs)) * 1e3
    parts = {k: round(v / runs * 1e3, 3) for k, v in timed.total.items()}
    calls = {k: v // runs for k, v in timed.calls.items()}
    return {"timed": True, "engine_ms": round(engine_ms, 3), "loop_decode_ms": round(decode_ms, 3),
            "ratio": round(engine_ms / decode_ms, 4), "host_ms_per_run": parts, "calls_per_run": calls}


def ttft_child(args) -> dict:
    L = args.prompt_len
    engine = _engine(args.model, args.scheme, L + 2 + args.gen_len + 1)
    tok = Tokenizer.byte_fallback(engine.config.vocab_size)
    gcfg = GenerationConfig(max_new_tokens=args.gen_len, stop_at_eos=False)
    first = _prompt(engine.config.vocab_size, L, 1)
    out = {"warm": args.warm, "module_loading": os.environ.get("CUDA_MODULE_LOADING", "default")}
    if args.warm != "none":
        cap = L if args.warm == "full" else int(args.warm)
        out["warm_up_s"] = round(warm_up(engine, tok, [first], gcfg, max_prompt=cap), 4)
    for i in range(3):
        stats = generate(engine, tok, [_prompt(engine.config.vocab_size, L + i, 1 + i)], gcfg)[1]
        out[f"ttft_ms_{i}"] = round(stats.prefill_s * 1e3, 2)
        out[f"decode_tok_s_{i}"] = round(stats.tokens_per_s, 1)
    out["parts_ms"] = _prefill_parts(engine, tok, _prompt(engine.config.vocab_size, L + 3, 4), gcfg)
    return out


def _prefill_parts(engine, tok, prompt, gcfg) -> dict:
    """One more request (a new shape), its prefill's parts timed with a synchronize around each."""
    timed = _Timed(sync=True)
    timed.wrap(Engine, "forward", "forward")
    timed.wrap(GpuRowSampler, "observe", "observe")
    timed.wrap(GpuRowSampler, "sample", "sample")
    timed.wrap(generation, "_prefill", "prefill")
    stats = generate(engine, tok, [prompt], gcfg)[1]
    eager = timed.total["forward"]
    timed.total.clear()
    engine.forward(torch.tensor([prompt[:-1]]), engine.new_cache(1, len(prompt) + 8), prefill_graph=False, last=True)
    parts = {k: round(v * 1e3, 2) for k, v in timed.total.items()}
    return {"ttft": round(stats.prefill_s * 1e3, 2), "forward_in_generate": round(eager * 1e3, 2),
            "forward_again_new_shape": parts.get("forward")}


def probe_ttft(args) -> list[dict]:
    rows = []
    for warm in args.warm.split(","):
        for loading in args.module_loading.split(","):
            env = dict(os.environ, CUDA_MODULE_LOADING=loading) if loading != "default" else dict(os.environ)
            cmd = [sys.executable, "-m", "kernels_cu.lab.loop_probe", "ttft-child", "--model", args.model,
                   "--scheme", args.scheme, "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
                   "--warm", warm]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(done.stderr[-2000:])
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["loop", "ttft", "ttft-child"])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--scheme", default="awq")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--sampling", choices=list(SAMPLING), default="greedy", help="`loop`'s sampling")
    p.add_argument("--depths", default="3", help="pipe depths for `loop`, e.g. 2,3,4")
    p.add_argument("--warm", default="none,256,full")
    p.add_argument("--module-loading", default="default", help="CUDA_MODULE_LOADING values, e.g. default,EAGER")
    args = p.parse_args()
    if args.mode == "loop":
        for row in probe_loop(args):
            print(json.dumps(row))
    elif args.mode == "ttft":
        for row in probe_ttft(args):
            print(json.dumps(row))
    else:
        print(json.dumps(ttft_child(args)))


if __name__ == "__main__":
    main()
