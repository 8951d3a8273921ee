"""What a decode step costs around its kernels: graph boundaries, the sampler, the pipe's hand-off of the ids.

    python -m kernels_cu.lab.step_graphs --model llama3.2-1b --scheme awq --lm-head-int8 --steps 256

Times, per step (CUDA events around `--steps` steps, median of `--rounds`): the bench's one-step graph replayed
back to back; graphs of 2 and 4 steps (programmatic launch then chains each step's sampler to the next step's
embedding, which a graph boundary does not); the logits-only graph (no sampler: its cost by difference); and the
decode pipe's launch (replay, publish_ids into pinned memory, an event), what generate and serve run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kernels_cu import build
from kernels_cu.bench import random_weights
from kernels_cu.engine import EngineConfig
from kernels_cu.engine.graphs import api, record
from model_zoo.sampling import SamplingConfig

PROMPT = 512


@api
def capture_steps(engine, cache, gpu, steps: int):
    """A graph of `steps` sampled decode steps in a row (each feeds the next on the device)."""
    return record(lambda: [engine._step_body(cache, gpu) for _ in range(steps)][-1])


@api
def replay(engine, graph, times: int) -> None:
    with build.on_stream():
        for _ in range(times):
            graph.replay()


def per_step_us(run, steps: int, rounds: int) -> float:
    """Median over rounds of (events around `run()`) / steps, us."""
    stream = build.torch_stream()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            run()
            b.record()
            b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / steps)
    return statistics.median(times)


def main() -> None:
    from kernels_cu.engine import Engine
    from model_zoo.config import LlamaConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--scheme", default="awq")
    ap.add_argument("--lm-head-int8", action="store_true")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    config = LlamaConfig.from_name(args.model)
    max_len = PROMPT + (args.rounds + 2) * args.steps + 8
    engine = Engine(random_weights(config, args.scheme, dev),
                    EngineConfig(max_len=max_len, lm_head_int8=args.lm_head_int8))
    sampler = engine.make_sampler(SamplingConfig(temperature=0), 1)
    cache = engine.new_cache(1, max_len)
    cache.lengths.fill_(PROMPT)
    engine.decode_sampled(torch.zeros(1, dtype=torch.long), cache, [0], sampler)  # the bench's graph
    one = cache.graphs["sampled"][0]
    results = {}
    for s in (1, 2, 4):
        g = one if s == 1 else capture_steps(engine, cache, sampler.gpu, s)[0]
        cache.lengths.fill_(PROMPT)
        n = args.steps // s  # replays: n * s steps
        results[f"graph of {s} step(s)"] = per_step_us(lambda: replay(engine, g, n), n * s, args.rounds)
    cache.lengths.fill_(PROMPT)
    engine.forward(torch.zeros(1, 1, dtype=torch.long), cache)  # the logits-only graph (captured on first use)
    lg = cache.graphs["logits"][0]
    cache.lengths.fill_(PROMPT)
    results["logits only (no sampler)"] = per_step_us(lambda: replay(engine, lg, args.steps), args.steps, args.rounds)
    pipe = engine.decode_pipe(cache, sampler)
    pipe.join(0, 0, PROMPT)
    cache.lengths.fill_(PROMPT)

    def pipe_run() -> None:
        for _ in range(args.steps):
            pipe.launch()
    results["decode pipe launch"] = per_step_us(pipe_run, args.steps, args.rounds)
    print(f"{torch.cuda.get_device_name(dev)}: {args.model} {args.scheme}"
          f"{' int8 head' if args.lm_head_int8 else ''}, batch 1, us a step (median of {args.rounds} x {args.steps})")
    for name, us in results.items():
        print(f"  {name:28s} {us:8.1f}")


if __name__ == "__main__":
    main()
