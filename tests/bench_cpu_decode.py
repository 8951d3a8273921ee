"""CPU decode speed: fllama's CPU backend against transformers' own fp32 generate, in one process.

    python -m tests.bench_cpu_decode                      # the default SmolLM2-135M, fp16 / int8 / awq
    python -m tests.bench_cpu_decode --tokens 64 --rounds 7 --int8 DIR --awq DIR --json

A benchmark, not a test (pytest collects test_*.py only). Each scheme is opened as `fllama generate --device
cpu` opens it (fllama_cli.runtime.open_model, load time included) and decodes the README's prompt greedily
through model_zoo.generation.generate, the CLI's own loop. transformers' LlamaForCausalLM gets the same fp32
weights (the loaded state dict) and runs generate(do_sample=False) at torch's default thread count. Rounds
interleave every contender, so a busy machine slows all of them alike; the figures are medians over rounds,
decode tok/s counted as the CLI counts it (tokens after the first over the time after the first). Without
--int8 / --awq, dynamic int8 and RTN AWQ (group 64) checkpoints are written to a temporary directory first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "The capital of France is"


def hf_model(loaded):
    """transformers' LlamaForCausalLM with the loaded fp32 weights (tied head tied as transformers ties it)."""
    import transformers

    keep = {k: v for k, v in loaded.config.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep)).eval()
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    if unexpected or any("lm_head" not in m for m in missing):
        raise RuntimeError(f"transformers did not take the weights: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float()


class _Clock:
    """A transformers streamer that notes when each generated token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_hf(model, ids: list[int], tokens: int) -> float:
    """Decode tok/s of transformers' greedy generate: tokens after the first over the time after the first."""
    clock = _Clock()
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       streamer=clock, pad_token_id=0)
    gen = clock.times[1:]  # [prompt, token 1, ..., token n]
    return (len(gen) - 1) / (gen[-1] - gen[0])


def time_fllama(opened, ids: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(decode tok/s, time to first token s, tokens) of the CLI's generation loop, greedy."""
    from model_zoo.generation import GenerationConfig, generate
    from model_zoo.sampling import SamplingConfig

    cfg = GenerationConfig(max_new_tokens=tokens, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    results, stats = generate(opened.backend, opened.tokenizer, [ids], cfg)
    return stats.tokens_per_s, stats.prefill_s, results[0].tokens


def quantized_checkpoints(source: str | None, tmp: Path) -> dict[str, Path]:
    from calibrate.pipeline import QuantizeJob, run_quantize
    from calibrate.quantize import AwqMethod, QuantConfig
    from model_zoo.quant.formats import Scheme

    out = {"int8": tmp / "int8", "awq": tmp / "awq"}
    run_quantize(QuantizeJob(source, out["int8"], QuantConfig(Scheme.INT8), device="cpu"))
    run_quantize(QuantizeJob(source, out["awq"], QuantConfig(Scheme.AWQ, group_size=64, awq_method=AwqMethod.RTN),
                             device="cpu"))
    return out


def open_timed(source: str | None):
    from fllama_cli.options import DeviceChoice
    from fllama_cli.runtime import open_model

    t0 = time.perf_counter()
    opened = open_model(source, device=DeviceChoice.cpu)
    return opened, time.perf_counter() - t0


def run(args) -> dict:
    from model_zoo.load import load_model

    loaded = load_model(args.model, dtype=torch.float32)
    ids = loaded.tokenizer.encode(PROMPT)
    hf = hf_model(loaded)
    default_threads = args.hf_threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"int8": args.int8, "awq": args.awq}
        if not (args.int8 and args.awq) and not args.fp16_only:
            made = quantized_checkpoints(args.model, Path(tmp))
            paths = {k: v or made[k] for k, v in paths.items()}
        sources = {"fp16": args.model} if args.fp16_only else {"fp16": args.model, **paths}
        opened, load_s = {}, {}
        for scheme, src in sources.items():
            opened[scheme], load_s[scheme] = open_timed(None if src is None else str(src))
            if args.threads:
                opened[scheme].backend.threads = args.threads
    rates: dict[str, list[float]] = {k: [] for k in ["transformers", *opened]}
    ttft: dict[str, list[float]] = {k: [] for k in opened}
    tokens: dict[str, list[int]] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        torch.set_num_threads(default_threads)
        rates["transformers"].append(time_hf(hf, ids, args.tokens))
        for scheme, o in opened.items():
            rate, first, toks = time_fllama(o, ids, args.tokens)
            rates[scheme].append(rate)
            ttft[scheme].append(first)
            tokens[scheme] = toks
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__, "torch_default_threads": default_threads,
                        "fllama_threads": {k: o.backend.threads for k, o in opened.items()},
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
            "tokens": args.tokens, "rounds": args.rounds, "decode_tok_s_median": med, "decode_tok_s": rates,
            "speedup_vs_transformers": {k: v / med["transformers"] for k, v in med.items() if k != "transformers"},
            "ttft_s_median": {k: statistics.median(v) for k, v in ttft.items()}, "load_s": load_s,
            "backend": {k: o.describe() for k, o in opened.items()},
            "same_tokens_as_fp16": {k: t == tokens["fp16"] for k, t in tokens.items()}}


def _print(r: dict) -> None:
    m = r["machine"]
    print(f"{m['cores']} cores · torch {m['torch']} ({m['torch_default_threads']} threads by default; fllama "
          f"{m['fllama_threads']}) · load average {m['load_average_before'][0]:.2f} before, "
          f"{m['load_average_after'][0]:.2f} after · {r['tokens']} tokens x {r['rounds']} rounds")
    base = r["decode_tok_s_median"]["transformers"]
    print(f"{'':14}{'decode tok/s (median)':>22}{'x transformers':>16}{'TTFT ms':>10}{'load s':>9}  all rounds")
    for k, v in r["decode_tok_s_median"].items():
        ttft = r["ttft_s_median"].get(k)
        load = r["load_s"].get(k)
        rounds = " ".join(f"{x:.1f}" for x in r["decode_tok_s"][k])
        print(f"{k:14}{v:22.1f}{v / base:16.2f}{'-' if ttft is None else f'{ttft * 1e3:.0f}':>10}"
              f"{'-' if load is None else f'{load:.2f}':>9}  {rounds}")
    print(f"greedy tokens equal to fp16's: {r['same_tokens_as_fp16']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="fp16 source (default: SmolLM2-135M-Instruct)")
    p.add_argument("--int8", default=None, help="an int8 checkpoint directory (default: quantized here, dynamic)")
    p.add_argument("--awq", default=None, help="an AWQ checkpoint directory (default: quantized here, RTN g64)")
    p.add_argument("--fp16-only", action="store_true", help="only the unquantized model against transformers")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generate call")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians are over them")
    p.add_argument("--threads", type=int, default=None, help="torch threads of fllama's CPU backend (default: its own)")
    p.add_argument("--hf-threads", type=int, default=None, help="torch threads of transformers (default: torch's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    r = run(args)
    print(json.dumps(r)) if args.json else _print(r)


if __name__ == "__main__":
    main()
