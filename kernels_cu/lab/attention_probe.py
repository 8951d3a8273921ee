"""Where a decode-attention launch spends its time: `python -m kernels_cu.lab.attention_probe [--ctx 576]`.

Builds attention_fused.cu with -DFLLAMA_ATTN_PROBE (thread 0 of every fused block stamps %globaltimer at its
phases; the engine's build never has it) and prints, per phase, when the blocks reach it, in us after the
first block entered: the median block and the last block, medians over launches. Three settings, a preset's
attention at batch 1 (`--model`, default LLaMA-2-7B; RoPE mode, as the engine calls it):
    cold    stand-alone launches after a 256 MiB write that evicts the cache from L2
    warm    the same launch repeated at once (K/V in L2)
    engine  the engine's decode graph (a few layers, programmatic launch on): the last layer's attention,
            started while its q|k|v GEMV is still running, so phase 0 -> 1 includes waiting for that GEMV
The engine runs also print each phase by a unit's role: its block 0 (which combines), the middle blocks, and the
last active block (which writes the new token's k / v). `--off FIELD` probes each engine scheme again with that
Tuning boolean off; `--no-standalone` skips the first two.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch

PROBE_FLAG = "-DFLLAMA_ATTN_PROBE"

PHASES = ("entry", "split known", "copies issued", "stage 0 landed", "loop done", "partial written",
          "cluster barrier", "exit", "combine weights", "merge stored", "cluster wait passed", "combined",
          "wait passed", "query rotated")
SLOTS = 16  # u64 per block: 14 phases (8: the two-pass combine's weights, 11: block 0's combine), 1 unused, the SM
ROLES = ("block 0", "middle", "new token")  # a unit's first active block, the others' median, its last active one


def probe_buffers() -> list[tuple[int, int]]:
    """(device pointer, bytes) of fllama_attn_probe in each loaded copy of the attention module: PyCUDA's
    (plain launches) and launch_ex's (cluster and programmatic launches load the cubin a second time)."""
    from kernels_cu import build, launch_ex

    module, path = build._module("attention_fused.cu", ())
    bufs = [module.get_global("fllama_attn_probe")]
    ex = launch_ex.module_global(path, "fllama_attn_probe")
    return bufs + ([ex] if ex is not None else [])


def read_probe(bufs: list[tuple[int, int]]) -> torch.Tensor:
    """int64 [blocks, SLOTS] of the last launch's stamps (0 where a block did not reach a phase)."""
    import pycuda.driver as drv

    from kernels_cu import build

    build.synchronize()
    total = None
    for ptr, nbytes in bufs:
        host = torch.empty(nbytes // 8, dtype=torch.int64)
        drv.memcpy_dtoh(host.numpy(), ptr)
        total = host if total is None else total + host  # the other copy is all zeros
    return total.view(-1, SLOTS)


def clear_probe(bufs: list[tuple[int, int]]) -> None:
    import pycuda.driver as drv

    from kernels_cu import build

    for ptr, nbytes in bufs:  # on fllama's stream: ordered before the next launch
        drv.memset_d8_async(ptr, 0, nbytes, build.stream())
    build.synchronize()


def phase_times(stamps: torch.Tensor) -> list[tuple[float, float, int]]:
    """Per phase (median block us, last block us, blocks that reached it) after the first entry."""
    t0 = stamps[:, 0][stamps[:, 0] > 0].min()
    out = []
    for p in range(len(PHASES)):
        col = stamps[:, p]
        col = col[col > 0]
        if col.numel() == 0:
            out.append((float("nan"), float("nan"), 0))
            continue
        rel = (col - t0).double() / 1e3
        out.append((rel.median().item(), rel.max().item(), col.numel()))
    return out


def role_times(stamps: torch.Tensor, units: int) -> list[tuple[float, float, float]]:
    """Per phase, the (block 0, middle, new-token block) times, medians over the units, in us after the first
    entry. The grid is (S, units), so block u * S + split; a unit's active blocks are those that issued copies,
    splits 0 .. n_act - 1, and the last of them holds the new token's position."""
    t0 = stamps[:, 0][stamps[:, 0] > 0].min()
    per_unit = stamps[: int((stamps[:, 0] > 0).sum())].view(units, -1, SLOTS)
    rel = torch.where(per_unit > 0, (per_unit - t0).double() / 1e3, float("nan"))
    out = []
    for p in range(len(PHASES)):
        roles: list[list[float]] = [[], [], []]
        for u in range(units):
            n_act = int((per_unit[u, :, 2] > 0).sum())
            if n_act == 0:
                continue
            col = rel[u, :n_act, p]
            roles[0].append(col[0].item())
            roles[2].append(col[n_act - 1].item())
            if n_act > 2:
                roles[1].append(col[1:n_act - 1].nanmedian().item())
        out.append(tuple(statistics.median(r) if r else float("nan") for r in roles))
    return out


def summarize_roles(runs: list[list[tuple[float, float, float]]]) -> None:
    print(f"  by block ({' / '.join(ROLES)}; medians over units and launches; nan: not reached)")
    for p, phase in enumerate(PHASES):
        cells = [statistics.median(r[p][i] for r in runs) for i in range(len(ROLES))]
        print(f"  {p:>2} {phase:<20}" + "".join(f"{c:9.2f}" for c in cells))


def summarize(name: str, runs: list[list[tuple[float, float, int]]]) -> None:
    print(f"== {name} ({len(runs)} launches; us after the first block's entry: median block / last block)")
    for p, phase in enumerate(PHASES):
        med = statistics.median(r[p][0] for r in runs)
        last = statistics.median(r[p][1] for r in runs)
        n = runs[0][p][2]
        print(f"  {p:>2} {phase:<20} {med:8.2f} {last:8.2f}   ({n} blocks)")


def standalone(model: str, ctx: int, cap: int, launches: int) -> None:
    from kernels_cu import attention_decode as ad
    from kernels_cu import build
    from model_zoo.config import LlamaConfig

    c = LlamaConfig.from_name(model)
    B, H, Hkv, D = 1, c.n_heads, c.n_kv_heads, c.head_dim
    with build.on_stream():
        k = torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.float16)
        v = torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.float16)
        qkv = torch.randn(B, (H + 2 * Hkv) * D, device="cuda", dtype=torch.float16)
        cos_sin = torch.randn(cap, D, device="cuda", dtype=torch.float32)
        lengths = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        call = lambda: ad.attention_decode_rope(qkv, cos_sin, k, v, lengths, H)  # noqa: E731
        call()
    bufs = probe_buffers()
    for name, cold in (("cold", True), ("warm", False)):
        runs = []
        for _ in range(launches):
            with build.on_stream():
                if cold:
                    flush.fill_(1)
                else:
                    call()
            clear_probe(bufs)
            with build.on_stream():
                call()
            runs.append(phase_times(read_probe(bufs)))
        summarize(f"stand-alone {name}, {model} H={H} Hkv={Hkv}, batch 1, ctx {ctx}", runs)


def engine_run(model: str, scheme: str, ctx: int, layers: int, steps: int, off: str | None = None) -> None:
    from kernels_cu.attention_decode import SLOTS as HEAD_SLOTS
    from kernels_cu.bench import random_weights
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT
    from model_zoo.config import LlamaConfig
    from model_zoo.sampling import SamplingConfig

    dev = torch.device("cuda")
    config = dataclasses.replace(LlamaConfig.from_name(model), n_layers=layers)
    t = DEFAULT if off is None else dataclasses.replace(DEFAULT, **{off: False})
    engine = Engine(random_weights(config, scheme, dev), EngineConfig(max_len=ctx + steps + 64), t)
    sampler = engine.make_sampler(SamplingConfig(temperature=0), 1)
    cache = engine.new_cache(1, ctx + steps + 64)
    cache.lengths.fill_(ctx)
    engine.decode_sampled(torch.zeros(1, dtype=torch.long), cache, [0], sampler)
    engine.replay_steps(cache, 3)
    bufs = probe_buffers()
    # batch 1: a unit per kv head and group of HEAD_SLOTS query heads
    units = config.n_kv_heads * -(-(config.n_heads // config.n_kv_heads) // HEAD_SLOTS)
    runs, roles = [], []
    for _ in range(steps):
        clear_probe(bufs)
        engine.replay_steps(cache, 1)
        stamps = read_probe(bufs)
        runs.append(phase_times(stamps))
        roles.append(role_times(stamps, units))
    summarize(f"engine {model} {scheme}{f' {off} off' if off else ''}, batch 1, ctx ~{ctx}, layer {layers - 1} of a "
              f"{layers}-layer graph", runs)
    summarize_roles(roles)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b", help="the preset whose attention shape is probed")
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--cap", type=int, default=641, help="cache positions per row (the bench's max_len + 1)")
    ap.add_argument("--launches", type=int, default=30)
    ap.add_argument("--engine", default="fp16,awq", help="schemes to probe inside the engine ('' for none)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--off", default=None, help="also probe each engine scheme with this Tuning boolean off")
    ap.add_argument("--no-standalone", action="store_true", help="only the engine runs")
    args = ap.parse_args(argv)
    from kernels_cu.tuning import DEFAULT

    if args.off is not None and not isinstance(getattr(DEFAULT, args.off, None), bool):
        raise SystemExit(f"--off takes a Tuning boolean (attention_clusters, fold_int8, ...), not {args.off!r}")
    # the flag must be in place before build.py is first imported (it reads FLLAMA_NVCC_FLAGS once)
    os.environ["FLLAMA_NVCC_FLAGS"] = (os.environ.get("FLLAMA_NVCC_FLAGS", "") + " " + PROBE_FLAG).strip()
    from kernels_cu import build

    if PROBE_FLAG not in build.EXTRA_OPTIONS:
        raise SystemExit("kernels_cu.build was imported before the probe flag was set: run this as its own process")
    build.require_cuda()
    print(torch.cuda.get_device_name())
    if not args.no_standalone:
        standalone(args.model, args.ctx, max(args.cap, args.ctx + 1), args.launches)
    for scheme in (s for s in args.engine.split(",") if s):
        engine_run(args.model, scheme, args.ctx, args.layers, args.launches)
        if args.off:
            engine_run(args.model, scheme, args.ctx, args.layers, args.launches, args.off)


if __name__ == "__main__":
    main()
