"""Where a graph-replayed prefill's wall time goes beyond its kernels: the bench's prefill (kernels_cu/bench.py:
zero the lengths, the graph's replay with last=True, the first token sampled) timed with CUDA events, then one
run traced by torch.profiler (CUPTI: kernels, copies and memsets).

    python -m kernels_cu.lab.prefill_gaps --model llama2-7b --scheme fp16,fp8 --tokens 2048

Per scheme: the events' medians of the bench's prefill and of its graph's replay alone, alternated (the difference:
the host's work and the copies around the graph); from the trace, the GPU's span from the first activity to the last,
its busy and idle time inside it, the largest gaps with the activities on both sides, and the kernels' sum by name.
(The trace's host and GPU clocks are not aligned closely enough to time the host's lead from it.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from kernels_cu import build
from kernels_cu.bench import events_time, random_weights
from kernels_cu.engine import Engine, EngineConfig
from kernels_cu.lab.timeline import short_name
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class Activity:
    name: str
    start: float  # us, the trace's clock
    dur: float

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass(frozen=True)
class Gaps:
    span_us: float  # first GPU activity's start to the last one's end
    busy_us: float  # the union of GPU activities inside the span
    summed_us: float  # the activities' durations summed (overlaps counted twice)
    activities: int
    largest: tuple[tuple[float, str, str], ...]  # (gap us, before, after)
    by_name: tuple[tuple[str, float, int], ...]  # (kernel, us summed, launches)


def gaps_of(acts: list[Activity], top: int = 12) -> Gaps:
    """The GPU's busy and idle time from its activities' intervals."""
    acts = sorted(acts, key=lambda a: a.start)
    if not acts:
        raise SystemExit("the trace holds no GPU activity for the prefill: is CUPTI available?")
    busy, gaps, reach, prev = 0.0, [], acts[0].start, acts[0]
    for a in acts:  # the union of the intervals, and the holes in it
        if a.start > reach:
            gaps.append((a.start - reach, short_name(prev.name), short_name(a.name)))
        if a.end > reach:
            busy += a.end - max(a.start, reach)
            reach, prev = a.end, a
    sums: dict[str, list[float]] = defaultdict(list)
    for a in acts:
        sums[short_name(a.name)].append(a.dur)
    by_name = sorted(((n, sum(d), len(d)) for n, d in sums.items()), key=lambda t: -t[1])
    return Gaps(span_us=reach - acts[0].start, busy_us=busy, summed_us=sum(a.dur for a in acts), activities=len(acts),
                largest=tuple(sorted(gaps, reverse=True)[:top]), by_name=tuple(by_name))


def read_trace(path: str) -> list[Activity]:
    """The GPU activities (kernels, copies, memsets) of a chrome trace written by torch.profiler."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [Activity(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") in GPU_CATS]


def traced(fn) -> Gaps:
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return gaps_of(read_trace(path))
    finally:
        os.unlink(path)


def measure(model: str, scheme: str, tokens: int, repeat: int) -> tuple[float, float, Gaps]:
    """(the bench's prefill, its graph's replay alone: events' medians in us, the traced prefill's gaps)"""
    dev = torch.device("cuda")
    engine = Engine(random_weights(LlamaConfig.from_name(model), scheme, dev), EngineConfig(max_len=tokens + 64))
    prompt = torch.randint(0, engine.config.vocab_size, (1, tokens))
    sampler = engine.make_sampler(SamplingConfig(temperature=0), 1)
    cache = engine.new_cache(1, tokens + 64)

    def prefill() -> None:  # bench.bench_engine's
        cache.lengths.zero_()
        logits = engine.forward(prompt, cache, last=True)
        sampler.sample(logits[:, -1], [0])

    for _ in range(3):  # the graph is captured on the shape's second run
        prefill()
    if len(cache.prefill_graphs) != 1:
        raise SystemExit(f"expected one captured prefill graph, found {len(cache.prefill_graphs)}")
    graph = next(iter(cache.prefill_graphs.values()))[0]
    with torch.cuda.stream(build.torch_stream()):
        t0 = time.time()
        times = [t * 1e6 for _ in range(repeat) for f in (prefill, graph.replay) for t in events_time(f, 1)]
        print(f"# {scheme} timed from {t0:.3f} to {time.time():.3f} (epoch s): us {[round(t) for t in times]}",
              flush=True)
    gaps = traced(prefill)
    del engine, cache, graph
    torch.cuda.empty_cache()
    return statistics.median(times[0::2]), statistics.median(times[1::2]), gaps


def report(scheme: str, prefill_us: float, graph_us: float, g: Gaps, names: int) -> str:
    idle = g.span_us - g.busy_us
    lines = [f"== {scheme}: events {prefill_us / 1e3:.2f} ms, the graph alone {graph_us / 1e3:.2f} | traced: span "
             f"{g.span_us / 1e3:.2f} ms (busy {g.busy_us / 1e3:.2f}, idle {idle / 1e3:.2f} in "
             f"{g.activities} activities), summed {g.summed_us / 1e3:.2f}",
             "   largest gaps (us, before -> after):"]
    lines += [f"   {us:9.1f}  {a[:50]} -> {b[:50]}" for us, a, b in g.largest]
    lines.append("   kernels by name (ms summed, launches):")
    lines += [f"   {us / 1e3:8.3f} {n:5d}  {name[:90]}" for name, us, n in g.by_name[:names]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--scheme", default="fp16,fp8", help="comma-separated")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (batch 1)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--names", type=int, default=14, help="kernel names listed")
    args = ap.parse_args()
    for scheme in args.scheme.split(","):
        prefill_us, graph_us, g = measure(args.model, scheme, args.tokens, args.repeat)
        print(report(scheme, prefill_us, graph_us, g, args.names), flush=True)


if __name__ == "__main__":
    main()
