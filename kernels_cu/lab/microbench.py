"""GPU micro-benchmark of the GEMV, decode-attention and sampling kernels: `python -m kernels_cu.lab.microbench`.

Per LLaMA-2-7B shape and M in (1, 8, 16): the kernel's time, the bytes it must move (weights once,
activations and outputs), GB/s, and the percentage of the device-to-device copy bandwidth measured here
(bytes read + bytes written); beside it, torch (cuBLAS) on the same shape. Decode attention at contexts
512 and 4096 against torch's SDPA (`--only l2`: each decode GEMV at M = 1 with its weight cold and L2-resident,
single launches; `--only sample`: the GPU sampler at each --ms batch, one block a row against clusters of
--sample-blocks). Each timing replays a CUDA graph of REPS calls that rotate over enough
weight copies to overflow L2; the median over replays after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from kernels_cu import awq_wgmma, awq_wgmma_decode, build, int8_wgmma, tuning
from kernels_cu.attention_decode import attention_decode
from kernels_cu.awq_gemm import awq_dequantize, awq_gemm
from kernels_cu.awq_gemv import (AwqPacked, awq_batch_gemm, awq_gemv, awq_linear, awq_packed_dequantize,
                                 pack_for_gemv)
from kernels_cu.fp16_gemv import fp16_gemv, fp16_swiglu, w8a16_linear
from kernels_cu.int8_gemm import int8_gemm
from kernels_cu.sampling import GpuSampler, launch_blocks
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig

SHAPES_7B = [("qkv", 4096, 12288), ("o", 4096, 4096), ("gate|up", 4096, 22016), ("down", 11008, 4096)]


def model_shapes(name: str) -> list[tuple[str, int, int]]:
    """A preset's decode linears as (name, K, N), fused as the engine runs them."""
    c = LlamaConfig.from_name(name)
    h = c.hidden_size
    return [("qkv", h, c.q_size + 2 * c.n_kv_heads * c.head_dim), ("o", c.q_size, h),
            ("gate|up", h, 2 * c.ffn_size), ("down", c.ffn_size, h)]
REPS = 20  # calls per graph
REPLAYS = 60  # timed replays (median)
L2_FACTOR = 3  # weight copies span at least this many times the L2


@dataclass
class Row:
    op: str
    shape: str
    m: int
    us: float
    gbps: float
    pct_copy: float
    torch_us: float | None
    torch_what: str
    tflops: float | None = None  # prefill GEMM rows: 2 M K N / time (GB/s and % copy are then of the weights)

    @classmethod
    def of(cls, op: str, shape: str, m: int, us: float, nbytes: float, bw: float, torch_us: float | None = None,
           torch_what: str = "", tflops: float | None = None) -> "Row":
        """A row whose GB/s and % of the copy bandwidth `bw` (GB/s) come from the bytes moved in `us`."""
        gbps = nbytes / us / 1e3
        return cls(op, shape, m, us, gbps, 100 * gbps / bw, torch_us, torch_what, tflops)


def time_graph(fn: Callable[[int], object], n_copies: int) -> float:
    """Microseconds per call of fn(i) (i rotates over the copies), from CUDA-graph replays."""
    ts = build.torch_stream()
    with build.on_stream():
        for i in range(3):
            fn(i % n_copies)  # compile, allocate, warm caches of code
        ts.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ts):
            for i in range(REPS):
                fn(i % n_copies)
        for _ in range(5):
            g.replay()
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(ts)
            g.replay()
            end.record(ts)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / REPS)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written: the better of a memcpy node and
    an SM elementwise kernel (a captured memcpy may run on the copy engines, slower than the SMs read)."""
    n = 1 << 30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()  # [n / 4]
    dst = torch.empty_like(src)
    us_memcpy = time_graph(lambda i: dst.copy_(src), 1)
    us_kernel = time_graph(lambda i: torch.neg(src, out=dst), 1)
    return 2 * n / min(us_memcpy, us_kernel) / 1e3


def copies_for(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(16, -(-L2_FACTOR * l2 // max(nbytes, 1))))


def bench_int8_gemv(m: int, k: int, n: int, bw: float) -> Row:
    """The int8 GEMV kernel forced above DECODE_MAX_M rows (tuning.int8_gemv_max_m), against int8_gemm's choice."""
    with tuning.override(int8_gemv_max_m=max(m, 16), int8_gemv_max_n=n):
        return replace(bench_int8(m, k, n, bw), op="int8-gemv")


def bench_int8(m: int, k: int, n: int, bw: float) -> Row:
    nc = copies_for(n * k)
    w = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda") for _ in range(nc)]
    ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    a = torch.rand(m, device="cuda") * 0.01 + 1e-3
    us = time_graph(lambda i: int8_gemm(x, a, w[i], ws), nc)
    nbytes = n * k + m * k + n * 4 + m * n * 2
    # cuBLAS int8 needs M > 16: torch._int_mm at M = 17 is the closest torch can do
    xi = torch.randint(-127, 128, (17, k), dtype=torch.int8, device="cuda")
    t_us = time_graph(lambda i: torch._int_mm(xi, w[i].t()), nc)
    return Row.of("int8", f"{k}x{n}", m, us, nbytes, bw, t_us, "_int_mm M=17")


def bench_prefill(m: int, k: int, n: int, bw: float) -> list[Row]:
    """Prefill-sized GEMMs: fp16 cuBLAS; int8 as int8_gemm runs it (the wgmma kernel on Hopper) and the
    _int_mm + epilogue path it replaced; AWQ by the dequantize + cuBLAS path and by the fused wgmma kernel that
    awq_linear runs on Hopper."""
    nc = 2
    flop = 2 * m * k * n
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(nc)]
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda") for _ in range(nc)]
    ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    a = torch.rand(m, device="cuda") * 0.01 + 1e-3
    awq = [random_awq_packed(k, n, 128) for _ in range(nc)]

    def row(op: str, us: float, wbytes: float) -> Row:
        return Row.of(op, f"{k}x{n}", m, us, wbytes, bw, tflops=flop / us / 1e6)

    rows = [row("fp16 cuBLAS", time_graph(lambda i: torch.matmul(x, w16[i].t()), nc), 2 * n * k)]
    rows.append(row("int8 gemm", time_graph(lambda i: int8_gemm(xq, a, w8[i], ws), nc), n * k))
    saved, int8_wgmma.takes = int8_wgmma.takes, lambda q_x, n: False  # the other path: _int_mm + int8_dequant
    try:
        rows.append(row("int8 _int_mm", time_graph(lambda i: int8_gemm(xq, a, w8[i], ws), nc), n * k))
    finally:
        int8_wgmma.takes = saved
    if build.has_wgmma(torch.cuda.current_device()):
        rows += prefill_fp8(m, k, n, nc, row)
    # the path the fused GEMM replaced
    with tuning.override(awq_fused_prefill=False):
        rows.append(row("awq dq+cuBLAS", time_graph(lambda i: awq_linear(x, awq[i]), nc), awq[0].nbytes()))
    if awq_wgmma.takes(x, awq[0]):  # the fused kernel (awq_linear's prefill path on Hopper)
        rows.append(row("awq wgmma", time_graph(lambda i: awq_wgmma.launch(x, awq[i], None, None), nc),
                        awq[0].nbytes()))
    return rows


def prefill_fp8(m: int, k: int, n: int, nc: int, row: Callable[[str, float, float], Row]) -> list[Row]:
    """FP8 E4M3 at prefill sizes, both paths of fp8_wgmma.launch: the wgmma kernel (the tile `choose` takes) and,
    where this torch takes row-wise scales with fp16 output, cuBLASLt's fp8 GEMM (torch._scaled_mm)."""
    from kernels_cu import fp8_wgmma
    from kernels_cu.gemm_shapes import sm_count
    f8 = torch.float8_e4m3fn
    x8 = (torch.randn(m, k, device="cuda") * 8).to(f8)  # [m, k]
    w8 = [(torch.randn(n, k, device="cuda") * 8).to(f8) for _ in range(nc)]  # [n, k]
    a = torch.rand(m, device="cuda") * 0.01 + 1e-3
    ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
    y = torch.empty(m, n, device="cuda", dtype=torch.float16)
    paths = [fp8_wgmma.choose(m, n, sm_count())]
    if fp8_wgmma.library_takes(torch.cuda.current_device()):
        paths.append("library")
    return [row(f"fp8 {'wgmma ' if p != 'library' else ''}{p}", time_graph(
        lambda i, p=p: fp8_wgmma.launch(y, x8, a, 1, w8[i], ws, None, "plain", p), nc), n * k) for p in paths]


def bench_fp16(m: int, k: int, n: int, bw: float) -> Row:
    nc = copies_for(2 * n * k)
    w = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(nc)]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    us = time_graph(lambda i: fp16_gemv(x, w[i]), nc)
    t_us = time_graph(lambda i: torch.matmul(x, w[i].t()), nc)
    nbytes = 2 * (n * k + m * k + m * n)
    return Row.of("fp16", f"{k}x{n}", m, us, nbytes, bw, t_us, "cuBLAS fp16")


def bench_w8a16(m: int, k: int, n: int, bw: float) -> Row:
    """The int8 lm_head (fp16_gemv.cu's w8a16 entries: codes and a scale per channel), beside cuBLAS on the fp16
    weight of the same shape."""
    nc = copies_for(n * k)
    q = [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(nc)]
    s = [torch.rand(n, device="cuda") * 1e-3 + 1e-4 for _ in range(nc)]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    us = time_graph(lambda i: w8a16_linear(x, q[i], s[i]), nc)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies_for(2 * n * k))]
    t_us = time_graph(lambda i: torch.matmul(x, w16[i].t()), len(w16))
    nbytes = n * k + 4 * n + 2 * (m * k + m * n)
    return Row.of("w8a16", f"{k}x{n}", m, us, nbytes, bw, t_us, "cuBLAS fp16")


def bench_awq(m: int, k: int, n: int, bw: float, group: int = 128, splits: int | None = None) -> Row:
    nbytes_w = k * n // 2 + (k // group) * n * 2.5
    nc = copies_for(int(nbytes_w))
    qw = [torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda") for _ in range(nc)]
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device="cuda")
    sc = (torch.rand(k // group, n, device="cuda") * 0.01 + 1e-3).half()
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    us = time_graph(lambda i: awq_gemm(x, qw[i], qz, sc, splits=splits), nc)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(copies_for(2 * n * k))]
    t_us = time_graph(lambda i: torch.matmul(x, w16[i].t()), len(w16))
    nbytes = nbytes_w + 2 * (m * k + m * n)
    tag = f"awq g{group}" + (f" s{splits}" if splits else "")
    return Row.of(tag, f"{k}x{n}", m, us, nbytes, bw, t_us, "cuBLAS fp16")


def random_awq_packed(k: int, n: int, group: int = 128, swiglu: bool = False) -> AwqPacked:
    """Random int4 codes, zeros and small positive scales, repacked for awq_gemv."""
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device="cuda")
    sc = (torch.rand(k // group, n, device="cuda") * 0.01 + 1e-3).half()
    return pack_for_gemv(qw, qz, sc, swiglu=swiglu)


def bench_awq_gemv(m: int, k: int, n: int, bw: float, group: int = 128, batch: bool = False,
                   splits: int | None = None, wgmma: bool = False) -> Row:
    """The engine's AWQ kernels on the repacked layout: awq_gemv, or with `batch` the batch GEMM
    (awq_batch.cu; `splits` forces its K split count), or with `wgmma` its Hopper form (awq_wgmma_decode.cu)."""
    first = random_awq_packed(k, n, group)
    nbytes_w = first.nbytes()
    nc = copies_for(nbytes_w)
    packs = [first] + [AwqPacked(torch.randint_like(first.packed, -2**31, 2**31 - 1), first.terms, n, k, group,
                                 first.gs) for _ in range(nc - 1)]
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    if wgmma:
        us = time_graph(lambda i: awq_wgmma_decode.launch(x, packs[i], None, None, splits=splits), nc)
        tag = f"awq-wgmma g{group}" + (f" s{splits}" if splits else "")
    elif batch:
        us = time_graph(lambda i: awq_batch_gemm(x, packs[i], splits=splits), nc)
        tag = f"awq-batch g{group}" + (f" s{splits}" if splits else "")
    else:
        us = time_graph(lambda i: awq_gemv(x, packs[i]), nc)
        tag = f"awq-gemv g{group}"
    nbytes = nbytes_w + 2 * (m * k + m * n)
    return Row.of(tag, f"{k}x{n}", m, us, nbytes, bw)


def bench_awq_dequant(k: int, n: int, bw: float, group: int = 128) -> Row:
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, device="cuda")
    sc = (torch.rand(k // group, n, device="cuda") * 0.01 + 1e-3).half()
    out = torch.empty(k, n, dtype=torch.float16, device="cuda")
    us = time_graph(lambda i: awq_dequantize(qw, qz, sc, out=out), 1)
    nbytes = k * n // 2 + 2 * k * n
    return Row.of("awq dequant", f"{k}x{n}", 0, us, nbytes, bw)


def bench_awq_packed_dequant(k: int, n: int, bw: float, group: int = 128) -> Row:
    p = random_awq_packed(k, n, group)
    out = torch.empty(n, k, dtype=torch.float16, device="cuda")
    us = time_graph(lambda i: awq_packed_dequantize(p, out=out), 1)
    nbytes = p.nbytes() + 2 * k * n
    return Row.of("awq-gemv dequant", f"{k}x{n}", 0, us, nbytes, bw)


def bench_attention(b: int, ctx: int, bw: float, h: int = 32, hkv: int = 32, d: int = 128) -> Row:
    L = ctx
    k = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.float16)
    q = torch.randn(b, h, d, device="cuda", dtype=torch.float16)
    lengths = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    us = time_graph(lambda i: attention_decode(q, k, v, lengths), 1)
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    kx, vx = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    t_us = time_graph(lambda i: F.scaled_dot_product_attention(q4, kx, vx), 1)
    nbytes = 2 * b * hkv * ctx * d * 2
    return Row.of("attn decode", f"B{b} ctx{ctx}", b, us, nbytes, bw, t_us, "SDPA")


SAMPLE_VOCABS = (32000, 49152, 128256)  # LLaMA-2, SmolLM / StarCoder, Llama-3
SAMPLE_CONFIGS = {"greedy": SamplingConfig(temperature=0.0),
                  "top-k 50": SamplingConfig(temperature=1.0, top_k=50, top_p=1.0),
                  "top-p 0.9": SamplingConfig(temperature=1.0, top_k=0, top_p=0.9),
                  "default": SamplingConfig(temperature=0.7, top_k=40, top_p=0.95),  # fllama generate / chat
                  "temperature": SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)}  # an OpenAI request's


def bench_sample(V: int, b: int, what: str, blocks: int, bw: float) -> Row:
    """The GPU sampler over fp16 logits [b, V] at tuning's sample_cluster_blocks = blocks (0: one block a row; any
    vocabulary may take clusters here); the shape names the blocks a row its launch took. GB/s: the logits once."""
    logits = (torch.randn(b, V, device="cuda") * 3).half()  # [b, V]
    s = GpuSampler(b, V, [V + 1], seed=1, config=SAMPLE_CONFIGS[what])  # an eos id never drawn: no row finishes
    with tuning.override(sample_cluster_blocks=blocks, sample_cluster_min_vocab=0):
        us = time_graph(lambda i: s.sample(logits), 1)
        P = launch_blocks(b, V, logits.dtype, logits.device.index or 0)
    return Row.of(f"sample {what}", f"V{V} P{P}", b, us, 2 * b * V, bw)


def _launch_us(fn: Callable[[], object], before: Callable[[], object], n: int = 60) -> float:
    """Median microseconds of one launch of fn, right after before() (events around fn alone; the GPU is held
    back first, so the host has queued both before they run and no launch gap is timed)."""
    ts = []
    with build.on_stream():
        for _ in range(n):
            torch.cuda._sleep(2_000_000)  # ~1 ms: longer than the host needs to queue the rest
            before()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def decode_gemv(scheme: str, m: int, k: int, n: int, swiglu: bool = False) -> tuple[Callable[[], object], int]:
    """One decode GEMV call on random operands (fp16, int8, awq, or awq-batch: the AWQ batch GEMM), `swiglu`
    for the gate|up epilogue (fp16, AWQ), and its weight bytes. gemv_probe profiles the same calls."""
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    if scheme == "fp16":
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        return ((lambda: fp16_swiglu(x, w)) if swiglu else (lambda: fp16_gemv(x, w))), w.numel() * 2
    if scheme == "int8":
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        ws = torch.rand(n, device="cuda") * 0.01 + 1e-3
        q = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        a = torch.rand(m, device="cuda") * 0.01 + 1e-3
        return (lambda: int8_gemm(q, a, w8, ws)), w8.numel()
    p = random_awq_packed(k, n, swiglu=swiglu)
    return ((lambda: awq_batch_gemm(x, p)) if scheme == "awq-batch" else (lambda: awq_gemv(x, p))), p.nbytes()


def bench_l2_residency(kind: str, k: int, n: int, bw: float) -> list[Row]:
    """A decode GEMV (M = 1) with its weight cold (L2 overwritten first) and L2-resident (the same launch just
    before): how much of its time is DRAM. Single launches, so both include ~1.5 us of launch and drain."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn, nbytes = decode_gemv(kind, 1, k, n)
    torch.cuda.synchronize()
    with build.on_stream():
        for _ in range(3):
            fn()
    rows = []
    for tag, before in (("cold", lambda: flush.fill_(1)), ("L2", fn)):
        us = _launch_us(fn, before)
        rows.append(Row.of(f"{kind} {tag}", f"{k}x{n}", 1, us, nbytes, bw))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,16,32", help="token counts for the GEMV rows")
    ap.add_argument("--only", default="fp16,int8,awq,attn,dequant",
                    help="which groups to run (+ prefill; l2: decode GEMVs with the weight cold and L2-resident; "
                         "head: the lm_head, fp16 and int8 weights; sample: the GPU sampler)")
    ap.add_argument("--prefill-ms", default="2048", help="token counts for the prefill GEMM rows")
    ap.add_argument("--awq-splits", default="", help="also sweep these AWQ K-split counts, e.g. 8,16,32")
    ap.add_argument("--batch-splits", default="", help="also sweep the AWQ batch GEMM's K splits, e.g. 1,2,4")
    ap.add_argument("--sample-blocks", default="0,8",
                    help="sample group: sample_cluster_blocks values to time (0: one block a row), e.g. 0,4,8,16")
    ap.add_argument("--json", default="", help="write the rows to this file")
    ap.add_argument("--model", default="llama2-7b", help="the preset whose shapes are measured")
    args = ap.parse_args(argv)
    shapes = SHAPES_7B if args.model == "llama2-7b" else model_shapes(args.model)
    build.require_cuda()
    only = set(args.only.split(","))
    ms = [int(v) for v in args.ms.split(",")]
    bw = copy_bandwidth()
    info = build.device_info()
    print(f"{info['name']} ({info['sm_count']} SMs), driver {info['driver_version']}; copy bandwidth {bw:.0f} GB/s")
    rows: list[Row] = []
    for m in ms:
        for name, k, n in shapes:
            if "fp16" in only:
                rows.append(bench_fp16(m, k, n, bw))
            if "int8" in only:
                rows.append(bench_int8(m, k, n, bw))
                if m > 16:
                    rows.append(bench_int8_gemv(m, k, n, bw))
                    with tuning.override(int8_gemv_max_m=16):
                        rows.append(replace(bench_int8(m, k, n, bw), op="int8-intmm"))
            if "awq" in only:
                rows.append(bench_awq(m, k, n, bw))
                rows.append(bench_awq_gemv(m, k, n, bw))
                rows.append(bench_awq_gemv(m, k, n, bw, batch=True))
                if build.has_wgmma(torch.cuda.current_device()):  # the decode-batch GEMM on Hopper
                    rows.append(bench_awq_gemv(m, k, n, bw, wgmma=True))
                for s in filter(None, args.batch_splits.split(",")):
                    rows.append(bench_awq_gemv(m, k, n, bw, batch=True, splits=int(s)))
                for s in filter(None, args.awq_splits.split(",")):
                    rows.append(bench_awq(m, k, n, bw, splits=int(s)))
    if "head" in only:  # the lm_head: vocabulary x hidden
        c = LlamaConfig.from_name(args.model)
        v, h = c.vocab_size, c.hidden_size
        rows += [r for m in ms for r in (bench_fp16(m, h, v, bw), bench_w8a16(m, h, v, bw))]
    if "dequant" in only:
        rows += [bench_awq_dequant(k, n, bw) for _, k, n in shapes]
        rows += [bench_awq_packed_dequant(k, n, bw) for _, k, n in shapes]
    if "prefill" in only:
        rows += [r for m in map(int, args.prefill_ms.split(",")) for _, k, n in shapes for r in bench_prefill(m, k, n, bw)]
    if "attn" in only:
        rows += [bench_attention(b, ctx, bw) for ctx in (512, 4096) for b in (1, 8, 32)]
    if "sample" in only:
        rows += [bench_sample(v, m, what, int(p), bw) for v in SAMPLE_VOCABS for m in ms for what in SAMPLE_CONFIGS
                 for p in args.sample_blocks.split(",")]
    if "l2" in only:
        rows += [r for _, k, n in shapes for kind in ("fp16", "int8", "awq") for r in bench_l2_residency(kind, k, n, bw)]
    print(f"{'op':<17}{'shape':<14}{'M':>5}{'us':>9}{'GB/s':>8}{'%copy':>7}{'torch us':>10}  vs torch")
    for r in rows:
        t = f"{r.torch_us:10.2f}  {r.torch_us / r.us:.2f}x {r.torch_what}" if r.torch_us else ""
        t += f"{r.tflops:10.0f} TFLOP/s" if r.tflops else ""
        print(f"{r.op:<17}{r.shape:<14}{r.m:>5}{r.us:9.2f}{r.gbps:8.0f}{r.pct_copy:7.1f}{t}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "copy_gbps": bw, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
