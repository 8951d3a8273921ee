"""sample_sort.cuh's bitonic network without a GPU: emulated stage by stage as the kernel runs it (two adjacent slots a
thread in registers: stride 1 inside a thread, 2-32 by lane shuffles, >= 64 through shared memory), it sorts any
candidate count up to the cap descending, pads last; and sampling.cu's candidate draw (nucleus and target over the
sorted slots) keeps what model_zoo's top-p rule keeps (the GPU tests check the kernels themselves)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.test_sampling_cluster_cpu import float_key, radix_candidates, radix_select

CAND_CAP, THREADS = 2048, 1024  # sample_select.cuh's CAND_CAP, sampling.cu's SAMPLE_THREADS


def bitonic_keep(x: np.ndarray, y: np.ndarray, e: np.ndarray, stride: int, size: int) -> np.ndarray:
    keep_max = ((e & stride) == 0) == ((e & size) == 0)
    return np.where(keep_max == (x > y), x, y)


def sort_candidates(cand: np.ndarray) -> np.ndarray:
    """The kernel's network over S slots: thread t holds slots 2t (a) and 2t + 1 (b); returns the S sorted slots."""
    n = len(cand)
    S = 64
    while S < n:
        S <<= 1
    slots = np.zeros(S, np.uint64)
    slots[:n] = cand
    e = 2 * np.arange(S // 2)  # the threads that hold slots
    a, b = slots[0::2].copy(), slots[1::2].copy()
    size = 2
    while size <= S:
        stride = size >> 1
        while stride > 0:
            if stride >= 64:  # through shared memory: every slot's partner from the last stage's values
                shared = np.empty(S, np.uint64)
                shared[0::2], shared[1::2] = a, b
                a, b = (bitonic_keep(a, shared[e ^ stride], e, stride, size),
                        bitonic_keep(b, shared[(e + 1) ^ stride], e + 1, stride, size))
            elif stride >= 2:  # __shfl_xor_sync(a, stride / 2): lane ^ (stride / 2), within a warp of 32 threads
                lane = np.arange(S // 2)
                partner = lane ^ (stride >> 1)
                assert (partner // 32 == lane // 32).all()
                a, b = bitonic_keep(a, a[partner], e, stride, size), bitonic_keep(b, b[partner], e + 1, stride, size)
            else:
                hi, lo = np.maximum(a, b), np.minimum(a, b)
                desc = (e & size) == 0
                a, b = np.where(desc, hi, lo), np.where(desc, lo, hi)
            stride >>= 1
        size <<= 1
    out = np.empty(S, np.uint64)
    out[0::2], out[1::2] = a, b
    return out


def keys(n: int, rng: np.random.Generator, ties: bool) -> np.ndarray:
    """Candidate keys as the kernel makes them: (float key << 32) | ~token, unique tokens, maybe tied values."""
    vals = rng.integers(1, 40 if ties else 2**32 - 1, n, dtype=np.uint64)
    tokens = rng.choice(200_000, n, replace=False).astype(np.uint64)
    return (vals << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - tokens)


@pytest.mark.parametrize("n", [0, 1, 2, 31, 63, 64, 65, 100, 127, 128, 129, 1000, 1024, 1025, 2047, 2048])
@pytest.mark.parametrize("ties", [False, True])
def test_the_network_sorts_any_candidate_count_descending(n, ties):
    cand = keys(n, np.random.default_rng(n), ties)
    got = sort_candidates(cand)
    assert len(got) >= max(n, 64) and len(got) <= max(64, 2 * n) and len(got) // 2 <= THREADS
    assert (got[:n] == np.sort(cand)[::-1]).all() and (got[n:] == 0).all()


def test_a_mutated_stage_fails():
    """The emulation would catch a wrong direction rule (the check above is not vacuous)."""
    global bitonic_keep
    real = bitonic_keep
    try:
        bitonic_keep = lambda x, y, e, stride, size: np.where(((e & stride) == 0) == (x > y), x, y)  # noqa: E731
        cand = keys(300, np.random.default_rng(1), False)
        assert not (sort_candidates(cand)[:300] == np.sort(cand)[::-1]).all()
    finally:
        bitonic_keep = real


def nucleus_draw(w: np.ndarray, top_p: float, z: np.float32, u: float) -> int:
    """sampling.cu's draw_candidates over sorted weights w (float32): pairs scanned over threads, the kept prefix
    counted from each slot's mass before it, the target in the kept mass, the first slot passing it."""
    f32 = np.float32
    n = len(w)
    pad = np.zeros(2 * ((n + 1) // 2), f32)
    pad[:n] = w
    w0, w1 = pad[0::2], pad[1::2]
    incl1 = np.cumsum((w0 + w1).astype(f32), dtype=f32)  # the block scan's order differs; float32 all the same
    excl0 = np.concatenate([[f32(0)], incl1[:-1]]).astype(f32)
    incl0 = (excl0 + w0).astype(f32)
    e = 2 * np.arange(len(w0))
    kept = n
    if top_p < 1.0:
        limit = f32(top_p) * z
        kept = max(int(((e < n) & (excl0 < limit)).sum() + ((e + 1 < n) & (incl0 < limit)).sum()), 1)
    incl = np.empty(2 * len(w0), f32)
    incl[0::2], incl[1::2] = incl0, incl1
    s = incl[kept - 1]
    target = min(f32(u) * s, np.nextafter(s, f32(0)))
    passing = np.nonzero(incl[:kept] > target)[0]
    return int(passing[0]) if len(passing) else kept - 1


def test_the_candidate_draw_keeps_model_zoos_nucleus():
    """Over many draws each slot comes up only inside model_zoo's nucleus (the smallest prefix whose mass before each
    kept token is < top_p), in proportion to its weight."""
    import torch

    from model_zoo.sampling import filter_top_k_top_p

    rng = np.random.default_rng(3)
    logits = np.sort(rng.normal(0, 2, 300).astype(np.float32))[::-1].copy()
    w = np.exp(logits - logits[0]).astype(np.float32)
    z = np.float32(w.sum(dtype=np.float64))
    keep = torch.isfinite(filter_top_k_top_p(torch.from_numpy(logits)[None].double(), 0, 0.9))[0].numpy()
    draws = np.array([nucleus_draw(w, 0.9, z, u) for u in rng.random(20_000)])
    assert keep[draws].all() and 1 < keep.sum() < len(w)  # a nucleus that is neither one token nor all
    p = w[keep] / w[keep].sum()
    counts = np.bincount(draws, minlength=len(w))[keep]
    assert np.abs(counts / len(draws) - p).max() < 0.01


@pytest.mark.parametrize("k", [1, 40, 50, 1024])
@pytest.mark.parametrize("logits", ["normal", "wide", "few values", "nan and inf"])
def test_gathering_the_whole_bin_then_cutting_at_the_kth_keeps_the_top_k_and_its_ties(k, logits):
    """The select stops once the k-th key's bin and all above it fit the candidates; sorted, they are cut at the k-th
    key: the tokens of the exact top k with every tie of the k-th (model_zoo's rule), NaNs ranked above every number
    by the select (as torch.topk ranks them) and never drawn."""
    rng = np.random.default_rng(k)
    x = {"normal": rng.normal(0, 3, 128_256), "wide": rng.normal(0, 30, 128_256),
         "few values": rng.integers(0, 400, 128_256) / 7.0, "nan and inf": rng.normal(0, 3, 128_256)}[logits]
    x = x.astype(np.float16).astype(np.float32)
    if logits == "nan and inf":
        x[rng.choice(len(x), 60, replace=False)] = np.nan
        x[rng.choice(len(x), 20, replace=False)] = np.inf
        x[rng.choice(len(x), 20, replace=False)] = -np.inf
    x = x.tolist()
    keys = [float_key(v) for v in x]  # NaN (positive) above +inf
    hi, lo, passes = radix_select(keys, k, CAND_CAP)
    assert lo == 0 and passes <= 3  # stopped at a bin: at most two passes after the one the max pass counts
    nan = [math.isnan(v) for v in x]
    kth = sorted(keys, reverse=True)[k - 1]
    want = [v for v in range(len(x)) if keys[v] >= kth and not nan[v]]  # the exact select's candidates
    gathered = [(keys[v] << 32) | (0xFFFFFFFF - v) for v in range(len(x)) if keys[v] >= hi and not nan[v]]
    assert len(gathered) <= CAND_CAP
    ranked = sort_candidates(np.array(gathered, dtype=np.uint64))[:len(gathered)]  # the network on these candidates
    assert ranked.tolist() == sorted(gathered, reverse=True)
    got = radix_candidates(x, k, CAND_CAP)
    assert got == want and (k > sum(nan)) == (len(want) > 0)
