"""The GPU sampler's tokens and state from two trees, compared bit for bit.

A sampler change that must not change results (a faster pass, a cluster path) dumps every case with the old tree's
kernels and with the new, then compares:

    mkdir -p /tmp/old && git archive HEAD~1 kernels_cu model_zoo | tar -x -C /tmp/old   # the tree before
    PYTHONPATH=/tmp/old python kernels_cu/lab/sample_compare.py dump /tmp/old.pt
    python kernels_cu/lab/sample_compare.py dump /tmp/new.pt
    python kernels_cu/lab/sample_compare.py compare /tmp/old.pt /tmp/new.pt

Run as a file, so that PYTHONPATH picks the tree whose kernels run. Cases: vocabularies of 1,000 to 128,256 tokens
(aligned and not), fp16 and fp32 logits, greedy / temperature / top-k / top-p / repetition-penalty configs
(temperatures 2e-7 to 30, top-k 1 to 1,024), logits that are Gaussian, on the fp16 grid, a few values (ties past the
candidate cap), a few ulps either side of the key bins' edges after the temperature, random float bits (fp32), and
NaN / -NaN / +-inf; one block a row, and clusters of 8 on sm_90; three draws a case, then `seen`, `finished`, `rng`.
"""

from __future__ import annotations

import argparse
import os
import sys

# the script's own directory must not shadow the tree chosen by PYTHONPATH
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

# (temperature, top_k, top_p, repetition penalty)
CONFIGS = [(0.7, 40, 0.95, 1.0), (1.0, 50, 1.0, 1.0), (1.0, 0, 0.9, 1.0), (0.37, 1024, 1.0, 1.0),
           (1.9, 2, 1.0, 1.3), (0.05, 7, 0.5, 1.0), (30.0, 0, 0.99, 1.0), (0.7, 40, 0.8, 1.3), (0.9, 0, 1.0, 1.0),
           (0.0, 0, 1.0, 1.0), (1e-3, 100, 1.0, 1.0), (2e-7, 10, 1.0, 1.0), (0.61, 1, 1.0, 1.0), (1.0, 1000, 0.3, 1.0)]
VOCABS = [1000, 32000, 32003, 49152, 128256]
KINDS = ["randn", "grid", "few", "edges", "bits", "naninf"]
ROWS = 3


def _signs(n: int, V: int, g: torch.Generator) -> torch.Tensor:
    return torch.where(torch.rand(n, V, generator=g) < 0.5, -1.0, 1.0)  # [n, V]


def make_logits(kind: str, n: int, V: int, t: float, g: torch.Generator) -> torch.Tensor:
    """fp32 logits [n, V] on the CPU of one KINDS entry (t: the case's temperature, for the bin edges)."""
    if kind == "randn":
        return torch.randn(n, V, generator=g) * 3
    if kind == "grid":
        return (torch.randn(n, V, generator=g) * 3).half().float()
    if kind == "few":  # six values, zeros of both signs: thousands of ties each
        return torch.randint(0, 6, (n, V), generator=g).float() * 0.5 * _signs(n, V, g)
    if kind == "edges":  # +-t * 2^e, a few ulps either side: at the key bins' edges once divided by t
        e = torch.randint(-4, 5, (n, V), generator=g).float()
        base = _signs(n, V, g) * torch.exp2(e) * max(t, 1e-3)
        steps = torch.randint(-3, 4, (n, V), generator=g).to(torch.int32)
        return (base.view(torch.int32) + steps).view(torch.float32)
    if kind == "bits":  # random finite float bits
        x = torch.randint(-2**31, 2**31 - 1, (n, V), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    if kind == "naninf":
        x = torch.randn(n, V, generator=g) * 3
        r = torch.rand(n, V, generator=g)
        x[r < 0.001] = float("nan")
        x[(r >= 0.001) & (r < 0.002)] = float("inf")
        x[(r >= 0.002) & (r < 0.003)] = float("-inf")
        x[(r >= 0.003) & (r < 0.004)] = torch.tensor([-1], dtype=torch.int32).view(torch.float32)  # -NaN
        return x
    raise ValueError(f"unknown logits kind {kind!r}; one of {', '.join(KINDS)}")


def cases() -> list[tuple[int, torch.dtype, str, int]]:
    """(V, dtype, kind, config index) of every case; random float bits only in fp32."""
    return [(V, dt, kind, ci) for V in VOCABS for dt in (torch.float16, torch.float32) for kind in KINDS
            if not (kind == "bits" and dt == torch.float16) for ci in range(len(CONFIGS))]


def dump(path: str) -> int:
    """Every case's draws and state with this tree's kernels, saved to `path`; the number of cases."""
    from kernels_cu import build, tuning
    from kernels_cu.sampling import GpuSampler
    from model_zoo.sampling import SamplingConfig

    build.require_cuda()
    blocks = [0, 8] if build.has_clusters(torch.cuda.current_device()) else [0]
    out = {}
    with build.on_stream():
        for V, dtype, kind, ci in cases():
            t, k, p, pen = CONFIGS[ci]
            g = torch.Generator().manual_seed(1000 * V + 10 * ci + KINDS.index(kind) + (dtype == torch.float32))
            logits = make_logits(kind, ROWS, V, t, g).to(dtype).cuda()  # [ROWS, V]
            cfg = SamplingConfig(temperature=t, top_k=k, top_p=p, repetition_penalty=pen)
            for bl in blocks:
                s = GpuSampler(ROWS, V, [V + 1], seed=7 + ci, config=cfg)
                if pen != 1.0:
                    for r in range(ROWS):
                        s.observe(r, torch.nan_to_num(logits[r].float(), nan=0.0).topk(20).indices.tolist())
                with tuning.override(sample_cluster_blocks=bl, sample_cluster_min_vocab=0):
                    res = [s.sample(logits).clone() for _ in range(3)]
                build.synchronize()
                res += [s.seen.nonzero(), s.finished.clone(), s.rng.clone()]  # seen: its marked (row, token)s
                out[f"V{V} {str(dtype)[6:]} {kind} cfg{ci} P{bl}"] = [r.cpu() for r in res]
    torch.save(out, path)
    return len(out)


def differing(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """(keys of a whose tensors differ from b's or are missing there, keys only in b)."""
    def same(x: list, y: list) -> bool:
        return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))

    return [k for k in a if k not in b or not same(a[k], b[k])], [k for k in b if k not in a]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump", help="run every case with this tree's kernels").add_argument("out")
    cmp = sub.add_parser("compare", help="compare two dumps")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        from kernels_cu import build
        n = dump(args.out)
        print(f"dump: {n} cases -> {args.out} (kernels from {build.KERNEL_DIR})")
        return 0
    a, b = torch.load(args.a), torch.load(args.b)
    bad, extra = differing(a, b)
    print(f"compare: {len(a)} cases, {len(bad)} differ, {len(extra)} only in the second")
    for k in bad[:8]:
        print(f"  differs: {k}")
    return 1 if bad or extra else 0


if __name__ == "__main__":
    sys.exit(main())
