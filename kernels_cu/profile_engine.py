"""Where the engine's time goes: torch.profiler (CUPTI sees PyCUDA's kernels too) over a prefill and a few
graph-replayed decode steps on random weights.   python -m kernels_cu.profile_engine --scheme int8 --tokens 2048"""

from __future__ import annotations

import argparse

import torch

from kernels_cu.bench import random_weights
from kernels_cu.engine import Engine, EngineConfig
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig


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
    ap.add_argument("--skip-prefill", action="store_true", help="profile the decode steps only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    engine = Engine(random_weights(LlamaConfig.from_name(args.model), args.scheme, dev),
                    EngineConfig(max_len=args.tokens + 64, fold_norms=args.fold_norms,
                                 defer_int8_quant=args.defer_int8_quant))
    prompt = torch.randint(0, engine.config.vocab_size, (1, args.tokens))
    engine.forward(prompt, engine.new_cache(1, args.tokens + 8))  # warm-up
    sampler = engine.make_sampler(SamplingConfig(temperature=0), args.batch)
    cache = engine.new_cache(args.batch, args.tokens + 64)
    rows = list(range(args.batch))
    cache.lengths.fill_(args.tokens)
    engine.decode_sampled(torch.zeros(args.batch, dtype=torch.long), cache, rows, sampler)
    torch.cuda.synchronize()
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
