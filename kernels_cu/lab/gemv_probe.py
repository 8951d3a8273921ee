"""Each decode GEMV of a preset's shapes (LLaMA-2-7B by default) once, inside an NVTX range "probe", for Nsight Compute:

    ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight ... \\
        python -m kernels_cu.lab.gemv_probe [--ms 1] [--only awq,int8,fp16] [--model llama3-8b]

Warm-up calls (compilation, caches of code) run outside the range, so only the measured launches are profiled;
ncu flushes the L2 before each, so the weights come from DRAM as in the engine (the microbench's rotation of
copies does the same without ncu).
"""

from __future__ import annotations

import argparse

import torch

from kernels_cu.lab.microbench import decode_gemv, model_shapes

SWIGLU = "gate|up"  # the engine runs this shape with the SwiGLU epilogue (fp16 and awq)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1", help="token counts")
    ap.add_argument("--only", default="awq,int8,fp16", help="schemes: awq, awq-batch, int8, fp16")
    ap.add_argument("--model", default="llama2-7b", help="the preset whose decode shapes are probed")
    args = ap.parse_args(argv)
    for scheme in args.only.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            for name, k, n in model_shapes(args.model):
                fn, _ = decode_gemv(scheme, m, k, n, swiglu=name == SWIGLU)
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("probe")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                print(f"{scheme} {name} {k}x{n} M={m}", flush=True)


if __name__ == "__main__":
    main()
