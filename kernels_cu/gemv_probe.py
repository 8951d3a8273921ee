"""Each decode GEMV of the LLaMA-2-7B shapes once, inside an NVTX range "probe", for Nsight Compute:

    ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight ... \\
        python -m kernels_cu.gemv_probe [--ms 1] [--only awq,int8,fp16]

Warm-up calls (compilation, caches of code) run outside the range, so only the measured launches are profiled;
ncu flushes the L2 before each, so the weights come from DRAM as in the engine (the microbench's rotation of
copies does the same without ncu).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from kernels_cu.awq_gemv import awq_gemv, pack_for_gemv
from kernels_cu.fp16_gemv import fp16_gemv, fp16_swiglu
from kernels_cu.int8_gemm import int8_gemm

SHAPES_7B = [("qkv", 4096, 12288, False), ("o", 4096, 4096, False), ("gate|up", 4096, 22016, True),
             ("down", 11008, 4096, False)]  # (name, K, N, swiglu epilogue)


def _cases(scheme: str, m: int, k: int, n: int, swiglu: bool) -> Callable[[], object]:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    if scheme == "fp16":
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        return (lambda: fp16_swiglu(x, w)) if swiglu else (lambda: fp16_gemv(x, w))
    if scheme == "int8":
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
        q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        a = torch.rand(m, device="cuda") * 0.01 + 1e-3
        return lambda: int8_gemm(q, a, w8, ws)
    group = 128
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device="cuda")
    sc = (torch.rand(k // group, n, device="cuda") * 0.01 + 1e-3).half()
    p = pack_for_gemv(qw, qz, sc, swiglu=swiglu)
    return lambda: awq_gemv(x, p)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1", help="token counts")
    ap.add_argument("--only", default="awq,int8,fp16", help="schemes")
    args = ap.parse_args(argv)
    for scheme in args.only.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            for name, k, n, swiglu in SHAPES_7B:
                fn = _cases(scheme, m, k, n, swiglu)
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("probe")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                print(f"{scheme} {name} {k}x{n} M={m}", flush=True)


if __name__ == "__main__":
    main()
