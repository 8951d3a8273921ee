"""What a user's generation loop gets from the engine: decode tok/s of model_zoo.generate (the loop behind
`fllama generate` and `chat`: prefill, decode steps run ahead of the host, tokens detokenized and stop-checked as
they come) on the same engine and prompt length that bench.bench_engine times by graph replay alone."""

from __future__ import annotations

import statistics

import torch

from kernels_cu.bench import BenchConfig
from model_zoo.generation import GenerationConfig, generate
from model_zoo.tokenizer import Tokenizer


def bench_generate(engine, tokenizer: Tokenizer | None, cfg: BenchConfig, seed: int = 0) -> dict:
    """Median decode tok/s of generate() at batch 1 over cfg.repeat runs of cfg.gen_len tokens sampled by
    cfg.sampling (EOS ignored, so every run decodes the same number of steps), after one warm-up run that captures
    the graphs."""
    tok = tokenizer or Tokenizer.byte_fallback(engine.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.config.vocab_size, (cfg.prompt_len,), generator=g).tolist()
    gcfg = GenerationConfig(max_new_tokens=cfg.gen_len, sampling=cfg.sampling, stop_at_eos=False)
    sink: list[str] = []  # the text is streamed to a callback, as `generate` prints it

    def run() -> float:
        sink.clear()
        return generate(engine, tok, [prompt], gcfg, on_text=lambda _, t: sink.append(t))[1].tokens_per_s

    run()
    return {"generate_tok_s": statistics.median(run() for _ in range(cfg.repeat))}
