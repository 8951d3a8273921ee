"""FP8 prefill and batch decode around the GEMMs, LLaMA-2-7B shapes: `python -m kernels_cu.lab.fp8_prefill`.

--gemm: the four linears at M rows (default 8, 16, 32, 64) on the fp8 GEMV (what decode runs up to
tuning.fp8_gemv_max_m), on cuBLASLt's fp8 GEMM (torch._scaled_mm, fp8_wgmma.launch's "library"; from
tuning.fp8_library_min_m rows) and on cuBLAS fp16 (the fp16 engine's at 32 rows and more); microbench's timing
(CUDA-graph replays, weights rotated over copies that span the L2).
--parts: the work around a 2,048-token prefill's GEMMs, a layer's worth each: the RMSNorm's codes as separate
kernels (torch.add, rmsnorm, fp8_quantize) against fp8_rmsnorm (the add in the norm kernel), the SwiGLU's
(silu_mul_interleaved, fp8_quantize) against fp8_silu_mul; the final norm and lm_head on every position against the
last one only.
--engine: the whole prefill of 2,048 tokens (batch 1, eager, CUDA events), fp8 with tuning.fp8_fused_quant on and off
and fp16, each with the logits of every position and of the last only (forward(last=True), what generation and
`fllama bench` ask), alternated, medians.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kernels_cu import build, tuning
from kernels_cu.lab.microbench import SHAPES_7B, copies_for, copy_bandwidth, time_graph

FP8 = torch.float8_e4m3fn
T_PREFILL = 2048


def gemm_rows(ms: list[int], bw: float) -> None:
    from kernels_cu import fp8_wgmma
    from kernels_cu.fp8_gemm import fp8_gemm

    library = fp8_wgmma.library_takes(torch.cuda.current_device())
    print(f"GEMMs, us (% of copy bw on the weight bytes); cuBLASLt fp8 {'available' if library else 'NOT available'}")
    print(f"{'M':>4} {'linear':<8}{'K x N':<13}{'fp8 GEMV':>16}{'cuBLASLt fp8':>16}{'cuBLAS fp16':>16}")
    totals: dict[tuple[int, str], float] = {}
    for m in ms:
        for name, k, n in SHAPES_7B:
            nc = copies_for(n * k)
            w8 = [(torch.randn(n, k, device="cuda") * 8).to(FP8) for _ in range(nc)]  # [n, k]
            ws = torch.rand(n, device="cuda") * 0.01 + 1e-3  # [n]
            x8 = (torch.randn(m, k, device="cuda") * 8).to(FP8)  # [m, k]
            a = torch.rand(m, device="cuda") * 0.01 + 1e-3  # [m]
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)  # [m, n]
            cols = {"gemv": time_graph(lambda i: fp8_gemm(x8, a, w8[i], ws, wgmma=False), nc)}
            if library:
                cols["lib"] = time_graph(lambda i: fp8_wgmma.launch(y, x8, a, 1, w8[i], ws, None, "plain",
                                                                    "library"), nc)
            nc16 = copies_for(2 * n * k)
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(nc16)]  # [n, k]
            x16 = torch.randn(m, k, device="cuda", dtype=torch.float16)  # [m, k]
            cols["fp16"] = time_graph(lambda i: torch.mm(x16, w16[i].t(), out=y), nc16)
            cells = []
            for key, nbytes in (("gemv", n * k), ("lib", n * k), ("fp16", 2 * n * k)):
                us = cols.get(key)
                totals[(m, key)] = totals.get((m, key), 0.0) + (us or 0.0)
                cells.append(f"{us:8.2f} ({100 * nbytes / us / 1e3 / bw:4.1f}%)" if us else f"{'-':>16}")
            print(f"{m:>4} {name:<8}{f'{k}x{n}':<13}" + "".join(f"{c:>16}" for c in cells))
    for m in ms:
        print(f"M={m}: a layer's four GEMMs, us: fp8 GEMV {totals[(m, 'gemv')]:.1f}, cuBLASLt fp8 "
              f"{totals[(m, 'lib')]:.1f}, cuBLAS fp16 {totals[(m, 'fp16')]:.1f}")


def parts_rows(bw: float) -> None:
    from kernels_cu.fp8_quantize import fp8_quantize, fp8_rmsnorm, fp8_silu_mul
    from kernels_cu.rmsnorm import rmsnorm
    from kernels_cu.silu_mul import silu_mul_interleaved

    T, H, F, V = T_PREFILL, 4096, 11008, 32000
    h = torch.randn(T, H, device="cuda", dtype=torch.float16)  # [T, H] the residual stream
    t = torch.randn(T, H, device="cuda", dtype=torch.float16) * 0.01  # [T, H] o_proj's product
    y = torch.empty(T, H, device="cuda", dtype=torch.float16)
    w = torch.ones(H, device="cuda", dtype=torch.float16)
    gu = torch.randn(T, 2 * F, device="cuda", dtype=torch.float16)  # [T, 2F] interleaved gate|up product
    head = torch.randn(V, H, device="cuda", dtype=torch.float16) * 0.01  # [V, H]
    rows = [
        ("norm+quant: rmsnorm, fp8_quantize", lambda i: fp8_quantize(rmsnorm(h, w, 1e-5)), 3.5 * T * H),
        ("norm+quant: fp8_rmsnorm", lambda i: fp8_rmsnorm(h, w, 1e-5), 1.5 * T * H),
        ("add+norm+quant: torch.add, rmsnorm, fp8_quantize",
         lambda i: fp8_quantize(rmsnorm(torch.add(t, h, out=y), w, 1e-5)), 6.5 * T * H),
        ("add+norm+quant: fp8_rmsnorm(residual)", lambda i: fp8_rmsnorm(t, w, 1e-5, residual=h), 3.5 * T * H),
        ("silu+quant: silu_mul_interleaved, fp8_quantize",
         lambda i: fp8_quantize(silu_mul_interleaved(gu)), 7 * T * F),
        ("silu+quant: fp8_silu_mul", lambda i: fp8_silu_mul(gu), 5 * T * F),
        ("head: rmsnorm + lm_head + fp32, every position",
         lambda i: torch.mm(rmsnorm(h, w, 1e-5), head.t()).float(), 2 * V * H + 10 * T * V),
        ("head: rmsnorm + lm_head + fp32, last position",
         lambda i: torch.mm(rmsnorm(h[-1:].contiguous(), w, 1e-5), head.t()).float(), 2 * V * H),
    ]
    print(f"around a {T}-token prefill's GEMMs (LLaMA-2-7B), us a call (GB/s of the bytes it must move)")
    us = {}
    for name, fn, nbytes in rows:
        us[name] = time_graph(fn, 1)
        print(f"  {name:<52}{us[name]:9.1f} us {nbytes / us[name] / 1e3:7.0f} GB/s")
    old = (2 * us["add+norm+quant: torch.add, rmsnorm, fp8_quantize"]
           + us["silu+quant: silu_mul_interleaved, fp8_quantize"])
    new = 2 * us["add+norm+quant: fp8_rmsnorm(residual)"] + us["silu+quant: fp8_silu_mul"]
    head_gain = (us["head: rmsnorm + lm_head + fp32, every position"]
                 - us["head: rmsnorm + lm_head + fp32, last position"])
    print(f"a layer: separate {old:.1f} us, fused {new:.1f} us; x32 layers: {32 * (old - new) / 1e3:.2f} ms saved; "
          f"last-position logits: {head_gain / 1e3:.2f} ms saved (fp16 and fp8 alike)")


def engine_rows(rounds: int) -> None:
    from kernels_cu.bench import random_weights
    from kernels_cu.engine import Engine, EngineConfig
    from model_zoo.config import LlamaConfig

    c = LlamaConfig.from_name("llama2-7b")
    dev = torch.device("cuda")
    prompt = torch.randint(0, c.vocab_size, (1, T_PREFILL), generator=torch.Generator().manual_seed(0))
    cfg = EngineConfig(max_len=T_PREFILL + 8)
    fp8 = Engine(random_weights(c, "fp8", dev), cfg)
    fp16 = Engine(random_weights(c, "fp16", dev), cfg)
    variants = {"fp8 fused": fp8, "fp8 separate": fp8.variant(fp8_fused_quant=False), "fp16": fp16}
    caches = {name: eng.new_cache(1, T_PREFILL + 8) for name, eng in variants.items()}
    times: dict[tuple[str, bool], list[float]] = {}
    stream = build.torch_stream()
    for r in range(rounds + 1):  # round 0 warms up (kernel builds, cuBLAS heuristics, the _scaled_mm probe)
        for name, eng in variants.items():
            for last in (True, False):
                caches[name].lengths.zero_()
                with torch.cuda.stream(stream):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    eng.forward(prompt, caches[name], prefill_graph=False, last=last)
                    b.record()
                    b.synchronize()
                if r:
                    times.setdefault((name, last), []).append(a.elapsed_time(b))
    ms = {k: statistics.median(v) for k, v in times.items()}
    print(f"prefill of {T_PREFILL} tokens, batch 1, ms (tok/s), median of {rounds}")
    for (name, last), v in ms.items():
        print(f"  {name:<14} {'last position' if last else 'every position':<15}{v:8.2f} ms {T_PREFILL / v * 1e3:9.0f}")
    for last in (True, False):
        print(f"fp16 / fp8 fused ({'last' if last else 'every'} position): "
              f"{ms[('fp16', last)] / ms[('fp8 fused', last)]:.3f}x; fused saves "
              f"{ms[('fp8 separate', last)] - ms[('fp8 fused', last)]:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--ms", default="8,16,32,64", help="--gemm's row counts")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    build.require_cuda()
    with tuning.active(tuning.DEFAULT):
        bw = copy_bandwidth()
        print(f"{build.device_info()['name']}; copy bandwidth {bw:.0f} GB/s")
        if args.gemm:
            gemm_rows([int(v) for v in args.ms.split(",")], bw)
        if args.parts:
            parts_rows(bw)
        if args.engine:
            engine_rows(args.rounds)


if __name__ == "__main__":
    main()
