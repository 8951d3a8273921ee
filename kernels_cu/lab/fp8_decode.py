"""The FP8 decode GEMVs at LLaMA-2-7B shapes: `python -m kernels_cu.lab.fp8_decode --ms 1,8,32` (microbench's timing).

Rows per (K, N, M): the GEMV on e4m3 codes (fp8_gemm, what a step of M > 1 rows runs after its quantize kernel)
with 16 channels a block ("fp8 codes": fp8_gemv_mt4 above 16 rows); above 16 rows also with 16-row blocks,
tuning.fp8_gemv_block_rows = 16, with the weights converted on the integer pipe, tuning.fp8_gemv_alu_weights, and
with 32 channels a block, tuning.fp8_gemv_block_channels ("fp8 ch32", the engine's: 8- or 4-warp blocks; "x8": 8
only); at M > 1 also on the codes' fp16 values, tuning.fp8_gemv_fp16_x; at M > 1 the input's quantization,
rmsnorm + fp8_quantize against fp8_quantize_fold; at one row the self-quantizing entries:
without the deferred chain fp8_gemv_xq1 (o_proj, down_proj: every block reads the row for its max) or fp8_gemv_nq1
(q|k|v, gate|up: every block also sums the row's squares), with it (tuning.fp8_defer_max_rows) fp8_gemv_dq1 (the
max from attention's units or the gate|up GEMV) or fp8_gemv_fq1 (the norm from its producer's partials). Bytes:
weight, scales, activations and output.
"""

from __future__ import annotations

import argparse

import torch

from kernels_cu import build, tuning
from kernels_cu.lab.microbench import SHAPES_7B, Row, copies_for, copy_bandwidth, time_graph

FP8 = torch.float8_e4m3fn
# the wide 32-row blocks (fp8_gemv_w2x*): op -> their Tuning fields (x8: 8-warp blocks only)
WIDE = {"fp8 ch32": {"fp8_gemv_block_channels": 32},
        "fp8 ch32 x8": {"fp8_gemv_block_channels": 32, "fp8_gemv_wide_two_blocks": False}}


def bench_fp8(m: int, k: int, n: int, bw: float, norm: bool, swiglu: bool, quick: bool = False) -> list[Row]:
    """norm: the linear reads an RMSNorm's output (q|k|v, gate|up); swiglu: gate|up with its SwiGLU epilogue; quick:
    only the GEMVs on e4m3 codes (mt4 and, at M > 16, the wide blocks)."""
    from kernels_cu.fp8_gemm import (FoldQuant, NormIn, fp8_gemm, fp8_gemm_deferred, fp8_gemm_fold, fp8_linear,
                                     fp8_linear_norm, fp8_swiglu)
    from kernels_cu.int8_gemm import DeferredQuant

    nc = copies_for(n * k)
    w = [(torch.randn(n, k, device="cuda") * 8).to(FP8) for _ in range(nc)]  # [n, k] e4m3
    ws = torch.rand(n, device="cuda") * 0.01 + 1e-3  # [n]
    out = n // 2 if swiglu else n
    nbytes = n * k + 4 * n + m * k + 2 * m * out
    x8 = (torch.randn(m, k, device="cuda") * 8).to(FP8)  # [m, k]
    a = torch.rand(m, device="cuda") * 0.01 + 1e-3  # [m]
    gemm = fp8_swiglu if swiglu else fp8_gemm
    shape = f"{k}x{n}"
    with tuning.override(fp8_gemv_block_channels=16):  # 16 channels a block (fp8_gemv_mt4 above 16 rows)
        rows = [Row.of("fp8 codes", shape, m, time_graph(lambda i: gemm(x8, a, w[i], ws), nc), nbytes, bw)]
    if m > 16 and not quick:  # the 16-row blocks (two a panel at 32 rows, each converting the weight) and mt4a
        with tuning.override(fp8_gemv_block_rows=16):
            rows.append(Row.of("fp8 codes mt2", shape, m, time_graph(lambda i: gemm(x8, a, w[i], ws), nc), nbytes,
                               bw))
        with tuning.override(fp8_gemv_alu_weights=True, fp8_gemv_block_channels=16):
            rows.append(Row.of("fp8 codes mt4a", shape, m, time_graph(lambda i: gemm(x8, a, w[i], ws), nc), nbytes,
                               bw))
    if m > 16:
        for op, fields in WIDE.items():  # 32 channels a block (fp8_gemv_w2x*)
            with tuning.override(**fields):
                rows.append(Row.of(op, shape, m, time_graph(lambda i: gemm(x8, a, w[i], ws), nc), nbytes, bw))
    if quick:
        return rows
    if m > 1:  # the codes' fp16 values (tuning.fp8_gemv_fp16_x): the GEMV converts only the weights
        xh = x8.to(torch.float16)  # [m, k]
        rows.append(Row.of("fp8 values", shape, m, time_graph(lambda i: gemm(xh, a, w[i], ws), nc), nbytes + m * k,
                           bw))
    if m != 1:
        return rows + quantize_rows(m, k, bw, norm)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)  # [1, k]
    nbytes += k  # the fp16 row instead of its codes
    if norm:
        nw = torch.ones(k, device="cuda", dtype=torch.float16)  # [k]
        rows.append(Row.of("fp8 nq1", shape, 1, time_graph(
            lambda i: fp8_linear_norm(NormIn(x, nw, 1e-5), w[i], ws, swiglu=swiglu), nc), nbytes + 2 * k, bw))
        mx = x.float().abs().reshape(1, k // 8, 8).amax(-1)  # [1, k / 8]
        sq = x.float().pow(2).reshape(1, k // 8, 8).sum(-1)  # [1, k / 8]
        fq = FoldQuant(x, mx, sq, 1e-5)
        amax = torch.zeros(1, device="cuda") if swiglu else None  # a real step clears it in q|k|v
        rows.append(Row.of("fp8 fq1 (chain)", shape, 1, time_graph(
            lambda i: fp8_gemm_fold(fq, w[i], ws, swiglu=swiglu, row_amax=amax, maxima=swiglu), nc),
            nbytes + 8 * k // 8, bw))
    else:
        rows.append(Row.of("fp8 xq1", shape, 1, time_graph(lambda i: fp8_linear(x, w[i], ws, xq=True), nc),
                           nbytes, bw))
        parts = x.float().abs().reshape(1, 32, k // 32).amax(-1)  # [1, 32]: attention's units
        dq = DeferredQuant(x, parts) if k == 4096 else DeferredQuant(x, None, row_amax=parts.amax(1))
        rows.append(Row.of("fp8 dq1 (chain)", shape, 1, time_graph(lambda i: fp8_gemm_deferred(dq, w[i], ws), nc),
                           nbytes, bw))
    return rows


def quantize_rows(m: int, k: int, bw: float, norm: bool) -> list[Row]:
    """A GEMV input of m > 1 rows: rmsnorm + fp8_quantize (norm) or fp8_quantize (one block a row each), against
    fp8_quantize_fold from the partials the chain's producers write (a row over several blocks)."""
    from kernels_cu.fp8_quantize import fp8_quantize, fp8_quantize_fold
    from kernels_cu.rmsnorm import rmsnorm

    x = torch.randn(m, k, device="cuda", dtype=torch.float16)  # [m, k]
    nw = torch.ones(k, device="cuda", dtype=torch.float16)  # [k]
    mx = x.float().abs().reshape(m, k // 8, 8).amax(-1)  # [m, k / 8]
    sq = x.float().pow(2).reshape(m, k // 8, 8).sum(-1) if norm else None  # [m, k / 8]
    nbytes = 3 * m * k
    plain = (lambda i: fp8_quantize(rmsnorm(x, nw, 1e-5))) if norm else (lambda i: fp8_quantize(x))
    return [Row.of("rmsnorm+quant" if norm else "fp8_quantize", f"{k}", m, time_graph(plain, 1), nbytes, bw),
            Row.of("quantize_fold", f"{k}", m, time_graph(lambda i: fp8_quantize_fold(x, mx, sq, 1e-5), 1),
                   nbytes, bw)]


def bench_fp8_shapes(ms: list[int], shapes: list[tuple[str, int, int]], bw: float, quick: bool = False) -> list[Row]:
    return [r for m in ms for name, k, n in shapes
            for r in bench_fp8(m, k, n, bw, norm=name in ("qkv", "gate|up"), swiglu=name == "gate|up", quick=quick)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,32", help="token counts")
    ap.add_argument("--quick", action="store_true", help="only the GEMVs on codes: mt4 and the wide blocks")
    args = ap.parse_args(argv)
    build.require_cuda()
    bw = copy_bandwidth()
    print(f"{build.device_info()['name']}; copy bandwidth {bw:.0f} GB/s")
    rows = bench_fp8_shapes([int(v) for v in args.ms.split(",")], SHAPES_7B, bw, args.quick)
    print(f"{'op':<17}{'shape':<14}{'M':>5}{'us':>9}{'GB/s':>8}{'%copy':>7}")
    for r in rows:
        print(f"{r.op:<17}{r.shape:<14}{r.m:>5}{r.us:9.2f}{r.gbps:8.0f}{r.pct_copy:7.1f}")
    for m in sorted({r.m for r in rows}):  # a layer's four linears, per variant
        print(f"M={m}: the four on codes, us: " + ", ".join(
            f"{op} {sum(r.us for r in rows if r.m == m and r.op == op):.1f}"
            for op in ("fp8 codes", "fp8 codes mt2", "fp8 codes mt4a", *WIDE, "fp8 values")
            if any(r.op == op and r.m == m for r in rows)))
    one = [r for r in rows if r.m == 1]
    if one:
        print(f"M=1: self-quantizing {sum(r.us for r in one if r.op in ('fp8 xq1', 'fp8 nq1')):.1f} us, "
              f"the deferred chain {sum(r.us for r in one if r.op.endswith('(chain)')):.1f} us")


if __name__ == "__main__":
    main()
