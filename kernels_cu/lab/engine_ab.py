"""A/B of engine options in one process: decode tok/s with an EngineConfig or Tuning field at each value, alternated.

    python -m kernels_cu.lab.engine_ab --switch fold_norms --scheme awq,fp16 --batch 1,8 --rounds 2
    python -m kernels_cu.lab.engine_ab --switch attention_clusters          # a Tuning boolean
    python -m kernels_cu.lab.engine_ab --switch quant_fold_early_rows --values 8,4,1   # a Tuning number, swept

Separate `fllama bench` processes differ by a few percent from run to run (clocks, copy bandwidth); one engine per
scheme and a variant of it per value (Engine.variant: the same weights on the GPU, caches and graphs of its own),
run in the order A B A B ..., keep the comparison to what the switch changes. Prefill is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kernels_cu.bench import BenchConfig, bench_engine, copy_bandwidth, random_weights
from kernels_cu.engine import EngineConfig
from kernels_cu.tuning import Tuning


def check_switch(name: str, numeric: bool = False) -> None:
    """SystemExit unless `name` is an EngineConfig or Tuning field of the right kind: a boolean, or with `numeric`
    an int or float."""
    defaults = {f.name: f.default for cls in (EngineConfig, Tuning) for f in dataclasses.fields(cls)}
    if name not in defaults:
        raise SystemExit(f"unknown EngineConfig or Tuning field {name!r}")
    value = defaults[name]
    if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SystemExit(f"{name} is not a number ({value!r})")
    if not numeric and not isinstance(value, bool):
        raise SystemExit(f"{name} is not a boolean ({value!r}): sweep it with --values")


def parse_values(text: str) -> list[float]:
    """--values "0,0.25,0.5" -> [0.0, 0.25, 0.5] (at least two)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--values takes numbers separated by commas, not {text!r}") from None
    if len(values) < 2:
        raise SystemExit("--values needs two values or more to compare")
    return values


def typed(name: str, value: float | bool) -> float | bool | int:
    """A swept value in the field's own type (an int field gets an int)."""
    default = {f.name: f.default for cls in (EngineConfig, Tuning) for f in dataclasses.fields(cls)}[name]
    return int(value) if isinstance(default, int) and not isinstance(default, bool) else value


def main() -> None:
    from kernels_cu.engine import Engine
    from model_zoo.config import LlamaConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, help="an EngineConfig or Tuning field (fold_norms, attention_clusters)")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--scheme", default="fp16,int8,awq")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs (rounds over all values with --values)")
    ap.add_argument("--lm-head-int8", action="store_true", help="the int8 lm_head (EngineConfig.lm_head_int8)")
    ap.add_argument("--values", default=None,
                    help="sweep a number over these values (comma-separated; gains against the first)")
    args = ap.parse_args()
    sweep = args.values is not None
    check_switch(args.switch, numeric=sweep)
    values = [typed(args.switch, v) for v in parse_values(args.values)] if sweep else [True, False]
    dev = torch.device("cuda", torch.cuda.current_device())
    bw = copy_bandwidth(dev)
    cfg = BenchConfig(batches=tuple(int(b) for b in args.batch.split(",")), prompt_len=args.prompt_len,
                      gen_len=args.gen_len, repeat=1)
    config = LlamaConfig.from_name(args.model)
    what = f"{args.switch} = {args.values} (gain against the first)" if sweep else f"{args.switch} on / off"
    print(f"{torch.cuda.get_device_name(dev)} copy {bw / 1e12:.2f} TB/s; decode tok/s, {what}")
    for scheme in args.scheme.split(","):
        base = Engine(random_weights(config, scheme, dev), EngineConfig(max_len=args.prompt_len + args.gen_len + 1,
                                                                         lm_head_int8=args.lm_head_int8))
        for b in cfg.batches:
            engines = {v: base.variant(**{args.switch: v}) for v in values}
            runs = {v: [] for v in values}
            for _ in range(args.rounds):
                for value in values:
                    runs[value].append(bench_engine(engines[value], b, cfg, bw)["decode_tok_s"])
            print(f"{scheme:5s} batch {b:3d}: {format_runs(runs, sweep)}", flush=True)
            del engines
            torch.cuda.empty_cache()
        del base
        torch.cuda.empty_cache()


def format_runs(runs: dict, sweep: bool) -> str:
    """A/B: "on a / b | off c / d | +x%"; a sweep: each value's runs and its gain against the first value."""
    each = {k: " / ".join(f"{v:,.1f}" for v in r) for k, r in runs.items()}
    if not sweep:
        return f"on {each[True]} | off {each[False]} | {100 * (sum(runs[True]) / sum(runs[False]) - 1):+.1f}%"
    base = sum(next(iter(runs.values())))
    return " | ".join(f"{k:g}: {each[k]} ({100 * (sum(r) / base - 1):+.1f}%)" for k, r in runs.items())


if __name__ == "__main__":
    main()
