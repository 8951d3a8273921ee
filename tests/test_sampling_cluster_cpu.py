"""The GPU sampler's cluster launch on a machine without a GPU: how many blocks a row takes (sampling.py), the
Tuning knobs' checks, sampling.cu's max/argmax pass emulated in Python, split over P blocks' slices, giving
the one-block pass's token for ties, -inf and NaN, and its radix select's candidates (the GPU tests check the kernel
itself)."""

from __future__ import annotations

import math
import struct
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
    assert cluster_blocks(1, 524288, 8, 40000, fits) == 8
    assert cluster_blocks(1, 524289, 8, 40000, fits) == 1  # past the segment sums block 0 holds
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


def float_key(x: float) -> int:
    """sample_values.cuh's monotone float -> uint32 key."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return (~b & 0xFFFFFFFF) if b & 0x80000000 else (b | 0x80000000)


def choose_digit(hist: list[int], need: int) -> tuple[int, int, int, bool]:
    """sample_select.cuh's choose_digit: the bin of the need-th largest -> (digit, remaining, tie, done)."""
    above = 0
    for d in range(255, -1, -1):
        if above < need <= above + hist[d]:
            return d, need - above, hist[d], hist[d] == need - above
        above += hist[d]
    raise AssertionError("no bin holds the need-th key")


def radix_select(keys: list[int], k: int, cap: int) -> tuple[int, int, int]:
    """sample_select.cuh's radix_select on one block (the integer counts are the same summed over any P blocks):
    (hi, lo, passes), the candidates' bound. Digits from the top until the k-th key's bin and every key above it fit
    `cap` (hi: that bin's least key, lo 0); else on to the k-th key and, its ties past `cap`, over ~token."""
    V, hi, lo, passes = len(keys), 0, 0, 0
    if k >= V:
        return hi, lo, passes
    remaining, mh = k, 0
    for shift in (24, 16, 8, 0):
        hist = [0] * 256
        for key in keys:
            if key & mh == hi:
                hist[(key >> shift) & 255] += 1
        digit, remaining, tie, _ = choose_digit(hist, remaining)
        hi, mh, passes = hi | digit << shift, mh | 255 << shift, passes + 1
        if k - remaining + tie <= cap:
            return hi, lo, passes
    remaining, ml = cap - (k - remaining), 0
    for shift in (24, 16, 8, 0):
        hist = [0] * 256
        for v, key in enumerate(keys):
            if key == hi and (0xFFFFFFFF - v) & ml == lo:
                hist[((0xFFFFFFFF - v) >> shift) & 255] += 1
        digit, remaining, _, done = choose_digit(hist, remaining)
        lo, ml, passes = lo | digit << shift, ml | 255 << shift, passes + 1
        if done:
            break
    return hi, lo, passes


def radix_candidates(x: list[float], k: int, cap: int) -> list[int]:
    """The tokens sampling.cu draws among: radix_select's bound, then gather's test (NaN never a candidate), then
    draw_candidates' cut of the sorted candidates at the k-th key, counting the NaNs the select ranked above every
    number (the k-th key's ties kept)."""
    keys = [float_key(v) for v in x]
    hi, lo, _ = radix_select(keys, k, cap)
    cand = [v for v in range(len(x))
            if not math.isnan(x[v]) and (keys[v] > hi or (keys[v] == hi and 0xFFFFFFFF - v >= lo))]
    r = k - sum(1 for v, key in enumerate(keys) if math.isnan(x[v]) and key > float_key(math.inf))
    if r <= 0:
        return []
    ranked = sorted(cand, key=lambda v: (-keys[v], v))
    return cand if r >= len(ranked) else [v for v in cand if keys[v] >= keys[ranked[r - 1]]]


def test_radix_select_keeps_the_top_k_with_ties_and_the_lowest_indices_past_the_cap():
    rng = random.Random(9)
    for trial in range(80):
        V = rng.choice([20, 57, 300, 513])
        x = [struct.unpack("<f", struct.pack("<f", rng.choice([-3.0, 0.5, 2.0]) * rng.randint(0, 3) / 4))[0]
             for _ in range(V)]  # few distinct values: long ties
        if trial % 4 == 0:
            x = [rng.gauss(0.0, 2.0) for _ in range(V)]
        cap = rng.choice([8, 24, 64])
        k = rng.randint(1, min(V, cap))
        keys = [float_key(v) for v in x]  # the kernel's order: -0.0 below +0.0
        order = sorted(range(V), key=lambda v: (-keys[v], v))
        want = [v for v in range(V) if keys[v] >= keys[order[k - 1]]]
        if len(want) > cap:
            want = sorted(order[:cap])
        assert radix_candidates(x, k, cap) == want, (trial, V, k, cap)
