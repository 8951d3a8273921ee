"""Decode-attention timings: `python -m kernels_cu.lab.attention_bench [--ctx 576,2048] [--batch 1,8,32]`.

LLaMA-2-7B attention (32 heads, 32 KV heads, head_dim 128 unless told), cache capacity --cap positions
(the engine allocates max_len + 1), every row at length ctx. Per variant, microseconds per call from
CUDA-graph replays rotating over KV-cache copies that span 3x the L2, GB/s of K/V bytes at that context
and the percentage of the device-to-device copy bandwidth:
    2kernel           attention_decode(fused=False): attn_decode_d* + attn_decode_combine
    fused             attention_decode: one launch
    2kernel+quantize  the int8 engine's attention today: two kernels, then quantize.py (dynamic)
    fused-quant       attention_decode_quant (dynamic per-token amax): one launch
    fused-ws          attention_decode with the workspace combine (no thread-block clusters: what the fused
    fused-quant-ws    launches are where their units' blocks are not clusters, and on GPUs before sm_90)
    fused-sN          the fused kernel with S = N splits per unit (--splits N,M: tuning)
"""

from __future__ import annotations

import argparse

import torch

from kernels_cu import attention_decode as ad
from kernels_cu import build, tuning
from kernels_cu.lab.microbench import copies_for, copy_bandwidth, time_graph
from kernels_cu.quantize import quantize


def without_clusters(fn):
    """fn with tuning.attention_clusters off while it runs (graph capture included)."""
    def run(i):
        with tuning.override(attention_clusters=False):
            return fn(i)
    return run


def bench(B: int, ctx: int, cap: int, H: int, Hkv: int, D: int, bw: float, splits: list[int]) -> list[tuple]:
    kv_bytes = 2 * Hkv * cap * D * 2 * B
    nc = copies_for(kv_bytes)
    with build.on_stream():
        ks = [torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.float16) for _ in range(nc)]
        vs = [torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.float16) for _ in range(nc)]
        q = torch.randn(B, H, D, device="cuda", dtype=torch.float16)
        lengths = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    variants = {
        "2kernel": lambda i: ad.attention_decode(q, ks[i], vs[i], lengths, fused=False),
        "fused": lambda i: ad.attention_decode(q, ks[i], vs[i], lengths),
        "2kernel+quantize": lambda i: quantize(ad.attention_decode(q, ks[i], vs[i], lengths, fused=False)
                                               .reshape(B, H * D)),
        "fused-quant": lambda i: ad.attention_decode_quant(q, ks[i], vs[i], lengths),
    }
    variants["fused-ws"] = without_clusters(variants["fused"])
    variants["fused-quant-ws"] = without_clusters(variants["fused-quant"])
    for s in splits:
        variants[f"fused-s{s}"] = (lambda s: lambda i: ad._launch_fused(q, ks[i], vs[i], lengths, None, None, None,
                                                                        None, quant=False, splits=s))(s)
    nbytes = 2 * B * Hkv * ctx * D * 2
    rows = []
    for name, fn in variants.items():
        us = time_graph(fn, nc)
        rows.append((name, B, ctx, us, nbytes / us / 1e3, 100 * nbytes / us / 1e3 / bw))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", default="576,2048,4096")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--cap", type=int, default=4097, help="cache positions per row")
    ap.add_argument("--heads", default="32,32,128", help="H,Hkv,D")
    ap.add_argument("--splits", default="", help="extra fused rows with these split counts")
    args = ap.parse_args(argv)
    H, Hkv, D = (int(x) for x in args.heads.split(","))
    splits = [int(s) for s in args.splits.split(",") if s]
    build.require_cuda()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s; H={H} Hkv={Hkv} D={D} cap={args.cap}")
    print(f"{'variant':<18} {'B':>3} {'ctx':>5} {'us':>8} {'GB/s':>7} {'%copy':>6}")
    for B in (int(b) for b in args.batch.split(",")):
        for ctx in (int(c) for c in args.ctx.split(",")):
            for name, b, c, us, gbps, pct in bench(B, ctx, max(args.cap, ctx), H, Hkv, D, bw, splits):
                print(f"{name:<18} {b:>3} {c:>5} {us:8.2f} {gbps:7.0f} {pct:6.1f}")


if __name__ == "__main__":
    main()
