"""Where the engine's time goes: torch.profiler (CUPTI sees PyCUDA's kernels too) over a prefill and a few
graph-replayed decode steps on random weights.   python -m kernels_cu.lab.profile_engine --scheme int8 --tokens 2048
With --timeline, the decode steps' critical path instead (timeline.py: what each kernel adds to the step when
programmatic launch overlaps them, which a table of durations overcounts)."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from kernels_cu.bench import random_weights
from kernels_cu.engine import Engine, EngineConfig, GpuCache
from kernels_cu.lab.timeline import Timeline, critical_path, format_timeline, kernels_from_trace
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig


def decode_timeline(engine: Engine, cache: GpuCache, steps: int) -> Timeline:
    """The critical path of `steps` replays of the cache's captured decode step (CUPTI through torch.profiler)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.replay_steps(cache, steps)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        kernels = kernels_from_trace(path)
    finally:
        os.unlink(path)
    return critical_path(kernels, "embedding")  # every decode step starts with the token embedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--scheme", default="fp16")
    ap.add_argument("--tokens", type=int, default=2048, help="prefill length (batch 1)")
    ap.add_argument("--batch", type=int, default=1, help="decode batch")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--fold-norms", action=argparse.BooleanOptionalAction, default=True,
                    help="decode RMSNorms deferred into the GEMVs (EngineConfig.fold_norms)")
    ap.add_argument("--defer-int8-quant", action=argparse.BooleanOptionalAction, default=True,
                    help="int8 decode quantizes inside the GEMVs (EngineConfig.defer_int8_quant)")
    ap.add_argument("--lm-head-int8", action="store_true", help="the int8 lm_head (EngineConfig.lm_head_int8)")
    ap.add_argument("--skip-prefill", action="store_true", help="profile the decode steps only")
    ap.add_argument("--timeline", action="store_true",
                    help="decode only: each kernel's critical-path increment over 8 replayed steps (timeline.py)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    engine = Engine(random_weights(LlamaConfig.from_name(args.model), args.scheme, dev),
                    EngineConfig(max_len=args.tokens + 64, fold_norms=args.fold_norms,
                                 defer_int8_quant=args.defer_int8_quant, lm_head_int8=args.lm_head_int8))
    prompt = torch.randint(0, engine.config.vocab_size, (1, args.tokens))
    if not args.timeline:  # the decode step alone needs no prefill warm-up
        engine.forward(prompt, engine.new_cache(1, args.tokens + 8))  # warm-up
    sampler = engine.make_sampler(SamplingConfig(temperature=0), args.batch)
    cache = engine.new_cache(args.batch, args.tokens + 64)
    rows = list(range(args.batch))
    cache.lengths.fill_(args.tokens)
    engine.decode_sampled(torch.zeros(args.batch, dtype=torch.long), cache, rows, sampler)
    torch.cuda.synchronize()
    if args.timeline:
        engine.replay_steps(cache, 10)  # warm
        cache.lengths.fill_(args.tokens)
        print(f"== {args.model} {args.scheme} decode batch {args.batch}, context {args.tokens}: critical path")
        print(format_timeline(decode_timeline(engine, cache, 8)))
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    runs = [("prefill", lambda: engine.forward(prompt, engine.new_cache(1, args.tokens + 8))),
            ("decode x20", lambda: engine.replay_steps(cache, 20))]
    for what, fn in runs[args.skip_prefill:]:
        with torch.profiler.profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== {args.model} {args.scheme} {what} (prefill {args.tokens} tokens, decode batch {args.batch})")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
