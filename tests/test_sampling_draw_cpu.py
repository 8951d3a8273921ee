"""sampling.cu's temperature-only draw without a GPU: its two levels (each 8,192-token segment's mass in the kernel's
summation order, then the segment and the token within it by a block scan) emulated in float32 give the exact
inverse CDF in index order but where float rounding moves a boundary; the vocabulary it holds every segment's sum
for (the GPU tests check the kernel itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_cu.sampling import MAX_VOCAB, GpuSampler, sample
from model_zoo.errors import ConfigError

THREADS, SEG = 1024, 8192  # sampling.cu's SAMPLE_THREADS and SEG_TOKENS
f32 = np.float32


def seq_sum(values: np.ndarray) -> np.float32:
    """Left to right in float32, as one thread adds."""
    total = f32(0)
    for v in values:
        total = f32(total + v)
    return total


def thread_chunks(e: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment s as the block holds it: each thread's 8 exps [THREADS, 8] (zeros past the row) and their sums in
    order [THREADS]."""
    chunk = np.zeros(SEG, f32)
    part = e[s * SEG:(s + 1) * SEG]
    chunk[:len(part)] = part
    lanes = chunk.reshape(THREADS, 8)
    t = lanes[:, 0].copy()
    for j in range(1, 8):
        t = (t + lanes[:, j]).astype(f32)
    return lanes, t


def segment_sums(e: np.ndarray) -> list[np.float32]:
    """gather: 8 tokens a thread in order, the warp's xor tree, the 32 warps in order."""
    sums = []
    for s in range(-(-len(e) // SEG)):
        w = thread_chunks(e, s)[1].reshape(32, 32)
        for o in (16, 8, 4, 2, 1):
            w = (w + w[:, np.arange(32) ^ o]).astype(f32)
        sums.append(seq_sum(w[:, 0]))
    return sums


def block_scan(part: np.ndarray) -> np.ndarray:
    """block_inclusive_scan: shfl_up steps within each warp, then the warps' totals scanned the same way."""
    def warp_scan(v: np.ndarray) -> np.ndarray:
        for o in (1, 2, 4, 8, 16):
            shifted = np.zeros_like(v)
            shifted[..., o:] = v[..., :-o]
            v = (v + shifted).astype(f32)
        return v
    v = warp_scan(part.reshape(32, 32))
    tot = warp_scan(v[:, 31].copy())
    v[1:] = (v[1:] + tot[:-1, None]).astype(f32)
    return v.reshape(-1)


def draw(e: np.ndarray, u: float) -> int:
    """draw_whole: the target's segment from the sums, then its token from the segment's block scan."""
    seg = segment_sums(e)
    z = seq_sum(seg)
    target = f32(f32(u) * z)
    run = f32(0)
    for s, m in enumerate(seg):
        if f32(run + m) > target and m > 0:
            break
        run = f32(run + m)
    rows, part = thread_chunks(e, s)
    incl = block_scan(part)
    rest = min(f32(target - run), np.nextafter(incl[-1], f32(0)))
    excl = np.concatenate([[f32(0)], incl[:-1]])
    t = int(np.nonzero((excl <= rest) & (rest < incl))[0][0])
    acc, last = excl[t], -1
    for j in range(8):
        acc = f32(acc + rows[t, j])
        if rows[t, j] > 0:
            last = j
            if acc > rest:
                return s * SEG + 8 * t + j
    return s * SEG + 8 * t + last


@pytest.mark.parametrize("V", [128256, 32003, 8192 * 3])
def test_the_two_level_draw_is_the_inverse_cdf_in_index_order(V):
    rng = np.random.default_rng(V)
    x = (rng.standard_normal(V) * 3).astype(f32)
    x[rng.integers(0, V, 50)] += 9.0  # a few likely tokens, spread over the segments
    e = np.exp(x - x.max()).astype(f32)
    cdf = np.cumsum(e.astype(np.float64))
    for u in rng.random(300):
        got, exact = draw(e, u), int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        if got != exact:  # float32 sums place the boundary between the two tokens a little apart
            edge = cdf[min(got, exact)]
            assert abs(u * cdf[-1] - edge) < 1e-5 * cdf[-1], (u, got, exact)
        assert e[got] > 0


def test_vocabularies_past_the_segment_sums_are_refused():
    with pytest.raises(ConfigError, match="2,097,152"):
        GpuSampler(1, MAX_VOCAB + 1, [0], device="cpu")
    logits = torch.zeros(1, MAX_VOCAB + 1)
    with pytest.raises(ValueError, match="2,097,152"):
        sample(logits, torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32),
               torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32))
