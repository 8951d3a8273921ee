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

from kernels_cu.awq_gemv import awq_batch_gemm, awq_gemv
from kernels_cu.fp16_gemv import fp16_gemv, fp16_swiglu
from kernels_cu.int8_gemm import int8_gemm
from kernels_cu.microbench import SHAPES_7B, random_awq_packed

SWIGLU = "gate|up"  # the engine runs this shape with the SwiGLU epilogue (fp16 and awq)


def _cases(scheme: str, m: int, name: str, k: int, n: int) -> Callable[[], object]:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    if scheme == "fp16":
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        return (lambda: fp16_swiglu(x, w)) if name == SWIGLU else (lambda: fp16_gemv(x, w))
    if scheme == "int8":
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
        q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        a = torch.rand(m, device="cuda") * 0.01 + 1e-3
        return lambda: int8_gemm(q, a, w8, ws)
    p = random_awq_packed(k, n, swiglu=name == SWIGLU)
    if scheme == "awq-batch":
        return lambda: awq_batch_gemm(x, p)
    return lambda: awq_gemv(x, p)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1", help="token counts")
    ap.add_argument("--only", default="awq,int8,fp16", help="schemes: awq, awq-batch, int8, fp16")
    args = ap.parse_args(argv)
    for scheme in args.only.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            for name, k, n in SHAPES_7B:
                fn = _cases(scheme, m, name, k, n)
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("probe")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                print(f"{scheme} {name} {k}x{n} M={m}", flush=True)


if __name__ == "__main__":
    main()
