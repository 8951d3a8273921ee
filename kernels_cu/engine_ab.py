"""A/B of engine options in one process: decode tok/s with an EngineConfig switch on and off, alternated.

    python -m kernels_cu.engine_ab --switch fold_norms --scheme awq,fp16 --batch 1,8 --rounds 2
    python -m kernels_cu.engine_ab --switch attention_decode.CLUSTERS   # a kernels_cu module's boolean
    python -m kernels_cu.engine_ab --switch engine.QUANT_FOLD_EARLY_ROWS --values 8,4,1   # a module number, swept

Separate `fllama bench` processes differ by a few percent from run to run (clocks, copy bandwidth); one engine
per scheme, its decode graphs re-captured at each switch, and the order A B A B ... keep the comparison to
what the switch changes. Prefill is not timed (the switches here are decode-step options).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import torch

from kernels_cu.bench import BenchConfig, bench_engine, copy_bandwidth, random_weights


def set_option(engine, name: str, value: bool | float) -> None:
    """Switch an EngineConfig field, or a launcher's module-level boolean or number ("module.NAME" in kernels_cu),
    and drop the captured decode graphs (they hold the old kernels)."""
    if "." in name:
        module, attr = name.split(".", 1)
        setattr(importlib.import_module(f"kernels_cu.{module}"), attr, value)
    else:
        engine.cfg = dataclasses.replace(engine.cfg, **{name: value})
    for cache in engine._caches.values():
        cache.graphs.clear()


def check_switch(name: str, fields: set[str], numeric: bool = False) -> None:
    """SystemExit unless `name` is a boolean EngineConfig field or a kernels_cu module's boolean attribute (numeric:
    a module's int or float attribute)."""
    if "." not in name:
        if numeric:
            raise SystemExit("--values sweeps a kernels_cu module's number (module.NAME)")
        if name not in fields:
            raise SystemExit(f"unknown EngineConfig field {name!r}")
        return
    module, attr = name.split(".", 1)
    try:
        value = getattr(importlib.import_module(f"kernels_cu.{module}"), attr)
    except (ImportError, AttributeError):
        raise SystemExit(f"no kernels_cu.{module}.{attr}") from None
    if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SystemExit(f"kernels_cu.{module}.{attr} is not a number ({value!r})")
    if not numeric and not isinstance(value, bool):
        raise SystemExit(f"kernels_cu.{module}.{attr} is not a boolean ({value!r})")


def parse_values(text: str) -> list[float]:
    """--values "0,0.25,0.5" -> [0.0, 0.25, 0.5] (at least two)."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--values takes numbers separated by commas, not {text!r}") from None
    if len(values) < 2:
        raise SystemExit("--values needs two values or more to compare")
    return values


def main() -> None:
    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.config import LlamaConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True,
                    help="a boolean EngineConfig field (fold_norms) or kernels_cu module attribute (attention_decode.CLUSTERS)")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--scheme", default="fp16,int8,awq")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs (rounds over all values with --values)")
    ap.add_argument("--values", default=None,
                    help="sweep a module's number over these values (comma-separated; gains against the first)")
    args = ap.parse_args()
    values = parse_values(args.values) if args.values is not None else [True, False]
    check_switch(args.switch, {f.name for f in dataclasses.fields(EngineConfig)}, numeric=args.values is not None)
    dev = torch.device("cuda", torch.cuda.current_device())
    bw = copy_bandwidth(dev)
    cfg = BenchConfig(batches=tuple(int(b) for b in args.batch.split(",")), prompt_len=args.prompt_len,
                      gen_len=args.gen_len, repeat=1)
    config = LlamaConfig.from_name(args.model)
    sweep = args.values is not None
    what = f"{args.switch} = {args.values} (gain against the first)" if sweep else f"{args.switch} on / off"
    print(f"{torch.cuda.get_device_name(dev)} copy {bw / 1e12:.2f} TB/s; decode tok/s, {what}")
    for scheme in args.scheme.split(","):
        engine = Engine(random_weights(config, scheme, dev), EngineConfig(max_len=args.prompt_len + args.gen_len + 1))
        for b in cfg.batches:
            runs = {v: [] for v in values}
            for _ in range(args.rounds):
                for value in values:
                    set_option(engine, args.switch, value)
                    runs[value].append(bench_engine(engine, b, cfg, bw)["decode_tok_s"])
            print(f"{scheme:5s} batch {b:3d}: {format_runs(runs, sweep)}", flush=True)
        del engine
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
