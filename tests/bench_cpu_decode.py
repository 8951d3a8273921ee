"""CPU decode speed: fllama's CPU backend against transformers' own fp32 generate, in one process.

    python -m tests.bench_cpu_decode                      # the default SmolLM2-135M, fp16 / int8 / awq
    python -m tests.bench_cpu_decode --fp32 --rounds 7    # + fllama with --cpu-dtype fp32 (the reference's numerics)
    python -m tests.bench_cpu_decode --tokens 64 --int8 DIR --awq DIR --json

A benchmark, not a test (pytest collects test_*.py only). Each scheme is opened as `fllama generate --device
cpu` opens it (fllama_cli.runtime.open_model: its default --cpu-dtype fp16, its threads, load time included) and
decodes the README's prompt greedily through model_zoo.generation.generate, the CLI's own loop.
transformers' LlamaForCausalLM gets the same fp32 weights (the loaded state dict) and runs
generate(do_sample=False) twice a round: on fllama's thread count (the matched comparison, the one the ratio
is taken against) and on torch's default count, when that differs. Rounds interleave every contender, so a
busy machine slows all of them alike; the figures are medians over rounds, decode tok/s counted as the CLI
counts it (tokens after the first over the time after the first), beside the CPU time each token took (less
sensitive to other jobs than wall time) and the 1-minute load average during the rounds. Without --int8 /
--awq, dynamic int8 and RTN AWQ (group 64) checkpoints are written to a temporary directory first.
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
    """A transformers streamer that notes when each generated token arrives, in wall and CPU time (the first
    put is the prompt)."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []

    def put(self, value) -> None:
        self.times.append((time.perf_counter(), time.process_time()))

    def end(self) -> None:
        pass


def time_hf(model, ids: list[int], tokens: int, threads: int) -> tuple[float, float]:
    """(decode tok/s, CPU ms a token) of transformers' greedy generate on `threads` torch threads: tokens after
    the first over the time after the first."""
    clock = _Clock()
    torch.set_num_threads(threads)
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       streamer=clock, pad_token_id=0)
    gen = clock.times[1:]  # [prompt, token 1, ..., token n]
    n = len(gen) - 1
    return n / (gen[-1][0] - gen[0][0]), (gen[-1][1] - gen[0][1]) / n * 1e3


def time_fllama(opened, ids: list[int], tokens: int) -> tuple[float, float, float, list[int]]:
    """(decode tok/s, CPU ms a token, time to first token s, tokens) of the CLI's generation loop, greedy."""
    from model_zoo.generation import GenerationConfig, generate
    from model_zoo.sampling import SamplingConfig

    cfg = GenerationConfig(max_new_tokens=tokens, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    backend, start = opened.backend, []
    step = backend.decode_sampled

    def timed_step(*a, **k):  # CPU time from the first decode step on: the prefill's is not the decode's
        start.append(start[0] if start else time.process_time())
        return step(*a, **k)

    backend.decode_sampled = timed_step  # an instance attribute over the method, for this call only
    try:
        results, stats = generate(backend, opened.tokenizer, [ids], cfg)
    finally:
        del backend.decode_sampled
    cpu_ms = (time.process_time() - start[0]) / len(start) * 1e3
    return stats.tokens_per_s, cpu_ms, stats.prefill_s, results[0].tokens


def quantized_checkpoints(source: str | None, tmp: Path) -> dict[str, Path]:
    from calibrate.pipeline import QuantizeJob, run_quantize
    from calibrate.quantize import AwqMethod, QuantConfig
    from model_zoo.quant.formats import Scheme

    out = {"int8": tmp / "int8", "awq": tmp / "awq"}
    run_quantize(QuantizeJob(source, out["int8"], QuantConfig(Scheme.INT8), device="cpu"))
    run_quantize(QuantizeJob(source, out["awq"], QuantConfig(Scheme.AWQ, group_size=64, awq_method=AwqMethod.RTN),
                             device="cpu"))
    return out


def open_timed(source: str | None, cpu_dtype=None):
    from fllama_cli.options import DeviceChoice
    from fllama_cli.runtime import open_model

    t0 = time.perf_counter()
    opened = open_model(source, device=DeviceChoice.cpu, cpu_dtype=cpu_dtype)
    return opened, time.perf_counter() - t0


def open_contenders(args, tmp: Path) -> tuple[dict, dict]:
    """{name: Opened} and {name: load s}: fp16 (the model as `fllama generate` opens it), int8, awq, fp32."""
    from model_zoo.cpu_fast import CpuDtype

    paths = {"int8": args.int8, "awq": args.awq}
    if not (args.int8 and args.awq) and not args.fp16_only:
        made = quantized_checkpoints(args.model, tmp)
        paths = {k: v or made[k] for k, v in paths.items()}
    sources = {"fp16": (args.model, None)}
    if not args.fp16_only:
        sources.update({k: (v, None) for k, v in paths.items()})
    if args.fp32:
        sources["fp16, --cpu-dtype fp32"] = (args.model, CpuDtype.FP32)
    opened, load_s = {}, {}
    for name, (src, dtype) in sources.items():
        opened[name], load_s[name] = open_timed(None if src is None else str(src), dtype)
    threads = args.threads or opened["fp16"].backend.threads  # chosen once, by the load when fp16 opened
    for o in opened.values():
        o.backend.threads = threads
    return opened, load_s


def run(args) -> dict:
    from model_zoo.load import load_model

    loaded = load_model(args.model, dtype=torch.float32)
    ids = loaded.tokenizer.encode(PROMPT)
    hf = hf_model(loaded)
    default_threads = args.hf_threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        opened, load_s = open_contenders(args, Path(tmp))
    threads = opened["fp16"].backend.threads
    hf_runs = {"transformers (matched)": threads}
    if default_threads != threads:
        hf_runs["transformers (default)"] = default_threads
    rates: dict[str, list[float]] = {k: [] for k in [*hf_runs, *opened]}
    cpu_ms: dict[str, list[float]] = {k: [] for k in rates}
    ttft: dict[str, list[float]] = {k: [] for k in opened}
    tokens: dict[str, list[int]] = {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name, n in hf_runs.items():
            rate, cpu = time_hf(hf, ids, args.tokens, n)
            rates[name].append(rate)
            cpu_ms[name].append(cpu)
        torch.set_num_threads(default_threads)
        for name, o in opened.items():
            rate, cpu, first, toks = time_fllama(o, ids, args.tokens)
            rates[name].append(rate)
            cpu_ms[name].append(cpu)
            ttft[name].append(first)
            tokens[name] = toks
        loads.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["transformers (matched)"]
    default = "transformers (default)" if "transformers (default)" in med else "transformers (matched)"
    return {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__, "torch_default_threads": default_threads,
                        "fllama_threads": threads, "load_average_1min": loads,
                        "load_average_median": statistics.median(loads)},
            "tokens": args.tokens, "rounds": args.rounds, "decode_tok_s_median": med, "decode_tok_s": rates,
            "cpu_ms_per_token_median": {k: statistics.median(v) for k, v in cpu_ms.items()},
            "speedup_vs_transformers_matched": {k: v / base for k, v in med.items() if k not in hf_runs},
            "speedup_vs_transformers_default": {k: v / med[default] for k, v in med.items() if k not in hf_runs},
            "ttft_s_median": {k: statistics.median(v) for k, v in ttft.items()}, "load_s": load_s,
            "backend": {k: o.describe() for k, o in opened.items()},
            "same_tokens_as_fp16": {k: t == tokens["fp16"] for k, t in tokens.items()}}


def _print(r: dict) -> None:
    m = r["machine"]
    loads = m["load_average_1min"]
    print(f"{m['cores']} cores · torch {m['torch']} · fllama and transformers (matched) on {m['fllama_threads']} "
          f"thread(s), torch's default {m['torch_default_threads']} · load average {min(loads):.1f}-{max(loads):.1f} "
          f"(median {m['load_average_median']:.1f}) · {r['tokens']} tokens x {r['rounds']} rounds")
    base = r["decode_tok_s_median"]["transformers (matched)"]
    print(f"{'':24}{'tok/s (median)':>15}{'x matched':>11}{'x default':>11}{'CPU ms/tok':>12}{'TTFT ms':>9}"
          f"{'load s':>8}  all rounds")
    for k, v in r["decode_tok_s_median"].items():
        ttft, load = r["ttft_s_median"].get(k), r["load_s"].get(k)
        vs_default = r["speedup_vs_transformers_default"].get(k)
        rounds = " ".join(f"{x:.1f}" for x in r["decode_tok_s"][k])
        print(f"{k:24}{v:15.1f}{v / base:11.2f}{'-' if vs_default is None else f'{vs_default:.2f}':>11}"
              f"{r['cpu_ms_per_token_median'][k]:12.1f}{'-' if ttft is None else f'{ttft * 1e3:.0f}':>9}"
              f"{'-' if load is None else f'{load:.2f}':>8}  {rounds}")
    print("x default: fllama on its own threads against transformers on torch's default (meaningful without "
          "--threads)")
    print(f"greedy tokens equal to fp16's: {r['same_tokens_as_fp16']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="fp16 source (default: SmolLM2-135M-Instruct)")
    p.add_argument("--int8", default=None, help="an int8 checkpoint directory (default: quantized here, dynamic)")
    p.add_argument("--awq", default=None, help="an AWQ checkpoint directory (default: quantized here, RTN g64)")
    p.add_argument("--fp16-only", action="store_true", help="only the unquantized model against transformers")
    p.add_argument("--fp32", action="store_true", help="also the unquantized model with --cpu-dtype fp32")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per generate call")
    p.add_argument("--rounds", type=int, default=5, help="rounds; medians are over them")
    p.add_argument("--threads", type=int, default=None, help="torch threads of fllama's CPU backend (default: its own)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="threads of the unmatched transformers run (default: torch's default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    r = run(args)
    print(json.dumps(r)) if args.json else _print(r)


if __name__ == "__main__":
    main()
