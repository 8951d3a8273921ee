"""A/B of engine options in one process: decode tok/s with an EngineConfig switch on and off, alternated.

    python -m kernels_cu.engine_ab --switch fold_norms --scheme awq,fp16 --batch 1,8 --rounds 2
    python -m kernels_cu.engine_ab --switch attention_decode.CLUSTERS   # a kernels_cu module's boolean

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


def set_option(engine, name: str, value: bool) -> None:
    """Switch an EngineConfig field, or a launcher's module-level boolean ("module.NAME" in kernels_cu), and drop
    the captured decode graphs (they hold the old kernels)."""
    if "." in name:
        module, attr = name.split(".", 1)
        setattr(importlib.import_module(f"kernels_cu.{module}"), attr, value)
    else:
        engine.cfg = dataclasses.replace(engine.cfg, **{name: value})
    for cache in engine._caches.values():
        cache.graphs.clear()


def check_switch(name: str, fields: set[str]) -> None:
    """SystemExit unless `name` is a boolean EngineConfig field or a kernels_cu module's boolean attribute."""
    if "." not in name:
        if name not in fields:
            raise SystemExit(f"unknown EngineConfig field {name!r}")
        return
    module, attr = name.split(".", 1)
    try:
        value = getattr(importlib.import_module(f"kernels_cu.{module}"), attr)
    except (ImportError, AttributeError):
        raise SystemExit(f"no kernels_cu.{module}.{attr}") from None
    if not isinstance(value, bool):
        raise SystemExit(f"kernels_cu.{module}.{attr} is not a boolean ({value!r})")


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
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs")
    args = ap.parse_args()
    check_switch(args.switch, {f.name for f in dataclasses.fields(EngineConfig)})
    dev = torch.device("cuda", torch.cuda.current_device())
    bw = copy_bandwidth(dev)
    cfg = BenchConfig(batches=tuple(int(b) for b in args.batch.split(",")), prompt_len=args.prompt_len,
                      gen_len=args.gen_len, repeat=1)
    config = LlamaConfig.from_name(args.model)
    print(f"{torch.cuda.get_device_name(dev)} copy {bw / 1e12:.2f} TB/s; decode tok/s, {args.switch} on / off")
    for scheme in args.scheme.split(","):
        engine = Engine(random_weights(config, scheme, dev), EngineConfig(max_len=args.prompt_len + args.gen_len + 1))
        for b in cfg.batches:
            runs = {True: [], False: []}
            for _ in range(args.rounds):
                for value in (True, False):
                    set_option(engine, args.switch, value)
                    runs[value].append(bench_engine(engine, b, cfg, bw)["decode_tok_s"])
            on, off = (" / ".join(f"{v:,.1f}" for v in runs[k]) for k in (True, False))
            gain = 100 * (sum(runs[True]) / sum(runs[False]) - 1)
            print(f"{scheme:5s} batch {b:3d}: on {on} | off {off} | {gain:+.1f}%", flush=True)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
