"""The GPU sampler's cluster launch on a machine without a GPU: how many blocks a row takes (sampling.py), the
Tuning knobs' checks, and sampling.cu's max/argmax pass emulated in Python, split over P blocks' slices, giving
the one-block pass's token for ties, -inf and NaN (the GPU tests check the kernel itself)."""

from __future__ import annotations

import math
import random
from functools import reduce

import pytest

from kernels_cu.sampling import cluster_blocks
from kernels_cu.tuning import Tuning

NONE = 0x7FFFFFFF  # ArgMax's "nothing yet" index (block_reduce.cuh)


def test_cluster_size_takes_the_largest_that_fits_in_one_wave():
    fits = lambda p: 132 // p  # noqa: E731  (one 1024-thread block a SM, no GPC boundaries)
    assert cluster_blocks(1, 128256, 8, 40000, fits) == 8
    assert cluster_blocks(32, 128256, 8, 40000, fits) == 4  # 132 // 5 = 26 clusters of 5 < 32 rows
    assert cluster_blocks(64, 128256, 16, 40000, fits) == 2
    assert cluster_blocks(128, 128256, 8, 40000, fits) == 1  # not even clusters of 2 fit: one block a row
    assert cluster_blocks(1, 128256, 16, 40000, fits) == 16
    assert cluster_blocks(1, 32000, 8, 40000, fits) == 1  # below the vocabulary threshold
    assert cluster_blocks(1, 20, 8, 0, fits) == 3  # no more blocks than 8-token chunks
    assert cluster_blocks(1, 128256, 8, 40000, None) == 1  # no clusters on this GPU
    assert cluster_blocks(1, 128256, 1, 40000, fits) == cluster_blocks(1, 128256, 0, 40000, fits) == 1
    assert cluster_blocks(0, 128256, 8, 40000, fits) == 1


@pytest.mark.parametrize("bad", [{"sample_cluster_blocks": 17}, {"sample_cluster_blocks": -1},
                                 {"sample_cluster_min_vocab": -1}])
def test_tuning_refuses_impossible_cluster_knobs(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Tuning(**bad)


def better(a: tuple[float, int], b: tuple[float, int]) -> tuple[float, int]:
    return b if (b[0] > a[0] or (b[0] == a[0] and b[1] < a[1])) else a


def kernel_argmax(x: list[float], P: int, threads: int = 4) -> int:
    """sampling.cu's max pass: row chunks of 8 split into P slices; a slice's chunk c goes to thread
    (c - c_lo) % threads, which visits its tokens in increasing order, taking the first non-NaN value, then strictly
    greater ones; better() over a block's threads, then over the cluster's blocks; no winner -> token 0."""
    V = len(x)
    chunks = -(-V // 8)
    per = -(-chunks // P)
    parts = []
    for rank in range(P):
        lo, hi = min(chunks, rank * per), min(chunks, rank * per + per)
        own = []
        for t in range(threads):
            best = (-math.inf, NONE)
            for v in (8 * c + e for c in range(lo + t, hi, threads) for e in range(8) if 8 * c + e < V):
                if x[v] > best[0] or (best[1] == NONE and not math.isnan(x[v])):
                    best = (x[v], v)
            own.append(best)
        parts.append(reduce(better, own))
    i = reduce(better, parts)[1]
    return i if i < V else 0


def reference(x: list[float]) -> int:
    """The largest non-NaN value's lowest index; 0 when every value is NaN."""
    ok = [v for v in range(len(x)) if not math.isnan(x[v])]
    return min(ok, key=lambda v: (-x[v], v)) if ok else 0


def test_argmax_over_slices_is_the_one_block_argmax():
    rng = random.Random(5)
    specials = [math.nan, -math.inf, math.inf, -0.0, 0.0]
    for trial in range(60):
        V = rng.choice([8, 13, 64, 203, 256, 391])
        x = [float(rng.randint(-3, 3)) for _ in range(V)]  # many ties
        for _ in range(rng.randint(0, 6)):
            x[rng.randrange(V)] = rng.choice(specials)
        if trial % 10 == 0:
            x = [rng.choice([math.nan, -math.inf]) for _ in range(V)]  # no finite value at all
        want = reference(x)
        for P in range(1, min(16, -(-V // 8)) + 1):
            assert kernel_argmax(x, P) == want, (trial, V, P, x)
