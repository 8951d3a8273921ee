"""CPU checks of the fused decode-attention kernel's index algebra (attention_fused.cu and its headers, namespace
fllama::fused).

Three things the GPU tests cannot pin down on their own, emulated here without a GPU:
- the run-time split of a row's tiles over the blocks of a unit covers every position exactly once, with
  at most S blocks active, for every length (the same formulas as the kernel);
- one warp's tile: ldmatrix / ldmatrix.trans fragments read from the padded shared-memory rows at the
  kernel's lane addresses, the P transpose buffer's slot order, the int8 conversions, and the accumulator
  -> (head, dim) mapping of the merge, through an emulated mma.sync (test_kernel_fragments' emulator);
- the online softmax per warp, the merge of the warps and the combine of the splits, as a float32 numpy
  model against a float64 softmax;
- the RoPE mode: the new token lies in the last stage of its unit's last block (the one block that stores
  it), and each lane's query words, rotated with the partner word the kernel picks, give rope_kv's q.
Plus the launch geometry (pure Python) and, where nvcc is installed, ptxas's report on the fused entries.
"""

from __future__ import annotations

import math
import re
import subprocess

import numpy as np
import pytest
import torch

from kernels_cu import build
from kernels_cu.attention_decode import (FUSED_PH_STRIDE, FUSED_STAGE, FUSED_STATIC_SMEM, FUSED_WARPS, MAX_SPLITS,
                                         FusedLaunch, fused_launch, fused_smem_bytes)
from kernels_cu.rope_kv import rope_kv_ref, rope_table
from tests.test_kernel_fragments import h2, i8x4_to_h2x2, mma_f16, prmt, u32, words_of

RNG = np.random.default_rng(6)


# ---------------------------------------------------------------- the split of a row over a unit's blocks

def split_ranges(length: int, L: int, S: int, span_tiles: int) -> list[tuple[int, int]]:
    """[lo, hi) of each active block, written as the kernel computes them."""
    n = min(max(length, 0), L)
    ntiles = (n + 15) // 16
    tps = span_tiles if span_tiles > 0 else max(1, (ntiles + S - 1) // S)
    n_act = (ntiles + tps - 1) // tps if n > 0 else 1
    assert n_act <= S, (length, L, S, span_tiles)
    return [(s * tps * 16, min(s * tps * 16 + tps * 16, n)) for s in range(n_act)]


@pytest.mark.parametrize("L,S", [(1, 1), (37, 3), (700, 12), (4097, 12), (2049, 49), (300, 512)])
def test_dynamic_split_covers_each_position_once(L, S):
    for length in range(0, L + 3):
        ranges = split_ranges(length, L, S, 0)
        n = min(length, L)
        if n == 0:
            assert ranges == [(0, 0)]  # block 0 writes the zeros of an empty row
            continue
        covered = [p for lo, hi in ranges for p in range(lo, hi)]
        assert covered == list(range(n))
        assert all(hi > lo and lo % 16 == 0 for lo, hi in ranges)


@pytest.mark.parametrize("chunk", [16, 48, 128, 512, 1008])
def test_fixed_chunk_split(chunk):
    L = 1500
    launch = fused_launch(L, 4, 4, 1, 128, False, 132, 228 * 1024, chunk=chunk)
    for length in (1, 17, 499, 1500):
        ranges = split_ranges(length, L, launch.splits, launch.span_tiles)
        assert [p for lo, hi in ranges for p in range(lo, hi)] == list(range(length))
        assert all(hi - lo <= chunk for lo, hi in ranges)


def test_launch_geometry():
    # LLaMA-2-7B at batch 1 on 132 SMs: d128 fp16 fits 3 blocks per SM -> 12 splits of 32 units = 384
    smem_sm = 228 * 1024
    assert fused_smem_bytes(128, False) == 2 * 2 * 64 * 272 + 4 * 8 * 24 * 2
    assert fused_smem_bytes(64, True) == 2 * (2 * 64 * 80 + 2 * 64 * 4) + 4 * 8 * 24 * 2
    one = fused_launch(4097, 1, 32, 1, 128, False, 132, smem_sm)
    assert (one.splits, one.units, one.span_tiles) == (12, 32, 0)
    assert fused_launch(4097, 1, 8, 1, 128, False, 132, smem_sm).splits == 49  # GQA: 8 units
    assert fused_launch(1030, 64, 32, 1, 128, False, 132, smem_sm).splits == 1  # batch 64: a block per row
    assert fused_launch(20, 1, 1, 1, 64, False, 132, smem_sm).splits == 2  # never more than the tiles
    assert fused_launch(10 ** 6, 1, 1, 1, 64, True, 132, smem_sm).splits == MAX_SPLITS
    with pytest.raises(ValueError):
        fused_launch(100, 1, 1, 1, 64, False, 132, smem_sm, chunk=24)


def test_cluster_choice():
    """A unit becomes one thread-block cluster where it has 2-16 blocks, with S lowered until every cluster fits
    in one wave; a fixed chunk keeps its S or stays off clusters."""
    smem_sm = 228 * 1024
    h200 = {12: 30, 11: 30, 10: 32, 9: 39, 8: 45, 3: 132, 2: 198}.get  # measured: d128 fp16, load balancing
    one = fused_launch(4097, 1, 32, 1, 128, False, 132, smem_sm, max_clusters=h200)
    assert (one.splits, one.cluster) == (10, True)  # 7B batch 1: 12 splits would need 32 of 30 clusters
    assert fused_launch(4097, 1, 32, 1, 128, False, 132, smem_sm) == FusedLaunch(12, 0, 32, 71168)
    # GQA at batch 1 (8 units, a wave would give 49 splits): clusters of CLUSTER_MAX, combined in shared memory
    gqa = lambda s: 8  # noqa: E731  (8 clusters of 16 fit: one block a SM)
    assert fused_launch(4097, 1, 8, 1, 128, False, 132, smem_sm, max_clusters=gqa) == FusedLaunch(16, 0, 8, 71168, True)
    assert fused_launch(4097, 1, 4, 1, 64, False, 132, smem_sm, max_clusters=gqa).splits == 16  # TinyLlama: 4 units
    assert not fused_launch(1030, 64, 32, 1, 128, False, 132, smem_sm, max_clusters=h200).cluster  # one block
    assert fused_launch(4097, 4, 32, 1, 128, False, 132, smem_sm, max_clusters=h200) == FusedLaunch(3, 0, 128, 71168, True)
    assert not fused_launch(4097, 1, 32, 1, 128, False, 132, smem_sm, max_clusters=lambda s: 31).cluster  # none fit
    fixed = fused_launch(1500, 1, 32, 1, 128, False, 132, smem_sm, chunk=128, max_clusters=h200)
    assert (fixed.splits, fixed.cluster) == (12, False)  # the chunk fixes S = 12, whose clusters do not fit
    assert fused_launch(1500, 1, 4, 1, 128, False, 132, smem_sm, chunk=128, max_clusters=h200).cluster  # 4 units
    with pytest.raises(ValueError):
        FusedLaunch(17, 0, 1, 1024, cluster=True)


# ---------------------------------------------------------------- one warp's tile, lane by lane

def ldmatrix_x4(buf: np.ndarray, addrs: list[int], trans: bool) -> list[list[int]]:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16: lane 8i + r names row r of matrix i (16 bytes); lane (g, t)
    receives, per matrix, elements (g, 2t..2t+1), or with .trans (2t..2t+1, g)."""
    regs = [[0] * 4 for _ in range(32)]
    for i in range(4):
        m = np.stack([buf[addrs[8 * i + r]:addrs[8 * i + r] + 16].view(np.float16) for r in range(8)])  # [8, 8]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs[lane][i] = u32(m[2 * t:2 * t + 2, g] if trans else m[g, 2 * t:2 * t + 2])
    return regs


def p_slot(p: int, kv8: bool) -> int:
    return p if kv8 else 4 * ((p & 7) >> 1) + 2 * (p >> 3) + (p & 1)


def acc_dim(mt: int, r: int, g: int, kv8: bool) -> int:
    if kv8:
        return 8 * (g + 8 * (mt >> 2)) + 2 * (mt & 3) + (r >> 1)
    return 16 * mt + g + 8 * (r >> 1)


def smem_rows(x: np.ndarray, row: int) -> np.ndarray:
    """16 cache rows as cp.async lays them out: row p at byte p * row (padding left as garbage)."""
    raw = x.view(np.uint8).reshape(16, -1)
    buf = RNG.integers(0, 256, 16 * row, dtype=np.uint8)
    for p in range(16):
        buf[p * row:p * row + raw.shape[1]] = raw[p]
    return buf


def scale8(words: list[int], s: float) -> list[int]:
    """int8 V: code (exact in fp16) * scale in fp32, one rounding to fp16."""
    return [u32((h2(w).astype(np.float32) * np.float32(s)).astype(np.float16)) for w in words]


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_fused_tile_fragments(D, kv8):
    MT = D // 16
    Q = RNG.standard_normal((8, D)).astype(np.float16)
    qbuf = Q.view(np.uint8).reshape(-1)
    if kv8:
        Kc = RNG.integers(-127, 128, (16, D)).astype(np.int8)
        Vc = RNG.integers(-127, 128, (16, D)).astype(np.int8)
        vs = (RNG.uniform(0.002, 0.02, 16)).astype(np.float32)
        row = D + 16
    else:
        Kc = RNG.standard_normal((16, D)).astype(np.float16)
        Vc = RNG.standard_normal((16, D)).astype(np.float16)
        row = 2 * D + 16
    kbuf, vbuf = smem_rows(Kc, row), smem_rows(Vc, row)

    # scores
    acc = [[0.0] * 4 for _ in range(32)]
    if kv8:
        kl, kh = [], []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            wl, wh = [], []
            for j in range(D // 64):
                for w in words_of(kbuf, g * row + t * (D // 4) + 16 * j, 4):
                    wl += i8x4_to_h2x2(w)
                for w in words_of(kbuf, (g + 8) * row + t * (D // 4) + 16 * j, 4):
                    wh += i8x4_to_h2x2(w)
            kl.append(wl)
            kh.append(wh)
    for st in range(MT):
        b = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if kv8:
                b.append(words_of(qbuf, 2 * (g * D + t * (D // 4) + 4 * st), 2))
            else:
                b.append([words_of(qbuf, 2 * (g * D + 16 * st + 2 * t), 1)[0],
                          words_of(qbuf, 2 * (g * D + 16 * st + 8 + 2 * t), 1)[0]])
        if kv8:
            a = [[kl[l][2 * st], kh[l][2 * st], kl[l][2 * st + 1], kh[l][2 * st + 1]] for l in range(32)]
        else:
            addrs = [((l & 7) + 8 * ((l >> 3) & 1)) * row + 16 * (l >> 4) + 32 * st for l in range(32)]
            a = ldmatrix_x4(kbuf, addrs, trans=False)
        d = mma_f16(a, b)
        acc = [[acc[l][r] + d[l][r] for r in range(4)] for l in range(32)]
    scores = np.full((8, 16), np.nan)  # [head, position]
    for l in range(32):
        g, t = l >> 2, l & 3
        for r in range(4):
            scores[2 * t + (r & 1), g + 8 * (r >> 1)] = acc[l][r]
    np.testing.assert_allclose(scores, Q.astype(np.float64) @ Kc.astype(np.float64).T, rtol=1e-9, atol=1e-6)

    # P through the warp's transpose buffer: written by the lanes that hold it, read as the B operand
    P = RNG.uniform(0, 1, (8, 16)).astype(np.float16)
    ph = np.full(8 * FUSED_PH_STRIDE, np.nan, dtype=np.float16)
    for l in range(32):
        g, t = l >> 2, l & 3
        for r in range(4):
            h, p = 2 * t + (r & 1), g + 8 * (r >> 1)
            ph[h * FUSED_PH_STRIDE + p_slot(p, kv8)] = P[h, p]
    pbuf = ph.view(np.uint8)
    b = [words_of(pbuf, 2 * ((l >> 2) * FUSED_PH_STRIDE + 4 * (l & 3)), 2) for l in range(32)]

    # O^T = V^T P^T
    out = np.full((8, D), np.nan)
    if kv8:
        Vf = (Vc.astype(np.float32) * vs[:, None]).astype(np.float16)  # [16, D] as the kernel dequantizes
        for i in range(D // 64):
            for jp in range(4):
                a = []
                for l in range(32):
                    g, t = l >> 2, l & 3
                    v = []
                    for r in range(4):
                        raw = words_of(vbuf, (4 * t + r) * row + 8 * (g + 8 * i), 2)
                        v.append(scale8(list(i8x4_to_h2x2(raw[0]) + i8x4_to_h2x2(raw[1])), vs[4 * t + r]))
                    a.append([prmt(v[0][jp], v[1][jp], 0x5410), prmt(v[0][jp], v[1][jp], 0x7632),
                              prmt(v[2][jp], v[3][jp], 0x5410), prmt(v[2][jp], v[3][jp], 0x7632)])
                d = mma_f16(a, b)
                for l in range(32):
                    for r in range(4):
                        out[2 * (l & 3) + (r & 1), acc_dim(4 * i + jp, r, l >> 2, True)] = d[l][r]
    else:
        Vf = Vc
        for mt in range(MT):
            addrs = [((l & 7) + 8 * (l >> 4)) * row + 16 * ((l >> 3) & 1) + 32 * mt for l in range(32)]
            d = mma_f16(ldmatrix_x4(vbuf, addrs, trans=True), b)
            for l in range(32):
                for r in range(4):
                    out[2 * (l & 3) + (r & 1), acc_dim(mt, r, l >> 2, False)] = d[l][r]
    np.testing.assert_allclose(out, P.astype(np.float64) @ Vf.astype(np.float64), rtol=1e-9, atol=1e-6)


# ---------------------------------------------------------------- the algorithm, as a float32 model

def fused_model(q: np.ndarray, K: np.ndarray, V: np.ndarray, length: int, S: int, span_tiles: int = 0):
    """One unit: q [R, D] query heads sharing K, V [L, D]. Per block: 4 warps, stages of 64 positions, warp
    w takes tile w of each stage with an online softmax; the warps merge; the splits combine in order."""
    f32 = np.float32
    R, D = q.shape
    scale_log2 = f32(math.log2(math.e) / math.sqrt(D))
    ranges = split_ranges(length, K.shape[0], S, span_tiles)
    if length == 0:
        return np.zeros((R, D), np.float16)
    parts = []
    for lo, hi in ranges:
        warps = []
        for w in range(FUSED_WARPS):
            m, l, o = np.full(R, -np.inf, f32), np.zeros(R, f32), np.zeros((R, D), f32)
            for t0 in range(lo + 16 * w, hi, FUSED_STAGE):
                pos = np.arange(t0, t0 + 16)
                ok = pos < hi
                kt = np.where(ok[:, None], K[np.minimum(pos, K.shape[0] - 1)], 0).astype(f32)
                vt = np.where(ok[:, None], V[np.minimum(pos, K.shape[0] - 1)], 0).astype(f32)
                x = np.where(ok[None, :], (q.astype(f32) @ kt.T) * scale_log2, -np.inf).astype(f32)  # [R, 16]
                mn = np.maximum(m, x.max(axis=1))
                alpha = np.exp2(m - mn)
                p = np.exp2(x - mn[:, None]).astype(np.float16).astype(f32)
                l = l * alpha + p.sum(axis=1)
                o = o * alpha[:, None] + p @ vt
                m = mn
            warps.append((m, l, o))
        M = np.max([wm for wm, _, _ in warps], axis=0)
        fs = [np.exp2(wm - M) for wm, _, _ in warps]
        parts.append((M, sum(f * wl for f, (_, wl, _) in zip(fs, warps)),
                      sum(f[:, None] * wo for f, (_, _, wo) in zip(fs, warps))))
    if len(parts) == 1:
        M, l, o = parts[0]
        return (o / l[:, None]).astype(np.float16)
    M = np.max([pm for pm, _, _ in parts], axis=0)
    ws = [np.exp2(pm - M) for pm, _, _ in parts]
    l = sum(w * pl for w, (_, pl, _) in zip(ws, parts))
    o = sum(w[:, None] * po for w, (_, _, po) in zip(ws, parts))
    return (o / l[:, None]).astype(np.float16)


@pytest.mark.parametrize("length,S,span", [(1, 12, 0), (37, 3, 0), (700, 12, 0), (700, 1, 0), (1500, 34, 3),
                                           (64, 12, 0), (65, 12, 0), (0, 4, 0)])
def test_fused_model_matches_softmax(length, S, span):
    R, D, L = 3, 64, 1600
    q = RNG.standard_normal((R, D)).astype(np.float16)
    K = RNG.standard_normal((L, D)).astype(np.float16)
    V = RNG.standard_normal((L, D)).astype(np.float16)
    K[length:] = np.nan  # never read past the length
    V[length:] = np.nan
    got = fused_model(q, K, V, length, S, span).astype(np.float64)
    if length == 0:
        assert (got == 0).all()
        return
    s = q.astype(np.float64) @ K[:length].astype(np.float64).T / math.sqrt(D)  # [R, n]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = (p / p.sum(axis=1, keepdims=True)) @ V[:length].astype(np.float64)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < 2e-3, rel


# ---------------------------------------------------------------- RoPE mode

@pytest.mark.parametrize("L,S,span", [(37, 3, 0), (700, 12, 0), (2100, 12, 0), (4097, 49, 0), (1500, 94, 1),
                                      (1500, 8, 13), (1500, 2, 63)])
def test_new_token_is_in_the_last_stage_of_the_last_block(L, S, span):
    """Position p = length - 1 belongs to the last active block only, and to its last stage: the block stores
    it before the copies of that stage (stage 0's when it is the only one, else after the loop's barrier)."""
    for length in range(1, L + 1):
        ranges = split_ranges(length, L, S, span)
        p = length - 1
        lo, hi = ranges[-1]
        assert lo <= p < hi and not any(a <= p < b for a, b in ranges[:-1]), (length, ranges)
        nstages = (hi - lo + FUSED_STAGE - 1) // FUSED_STAGE
        assert (p - lo) // FUSED_STAGE == nstages - 1


def rope_query_lanes(x: np.ndarray, cs_row: np.ndarray, kv8: bool) -> np.ndarray:
    """attention_rope.cuh's rope_query for one head group: x fp16 [8, D] raw query heads (head g in lane group
    g), cs_row fp32 [D] -> the rotated heads [8, D] as the lanes hold them afterwards."""
    D = x.shape[1]
    MT = D // 16
    xb = x.view(np.uint8).reshape(-1)
    words = []  # [lane][st][j] as the kernel's q load lays them out
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if kv8:
            words.append([words_of(xb, 2 * (g * D + t * (D // 4) + 4 * st), 2) for st in range(MT)])
        else:
            words.append([[words_of(xb, 2 * (g * D + 16 * st + 2 * t), 1)[0],
                           words_of(xb, 2 * (g * D + 16 * st + 8 + 2 * t), 1)[0]] for st in range(MT)])
    out = np.full((8, D), np.nan, dtype=np.float16)
    hits = np.zeros((8, D), dtype=int)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for st in range(MT):
            for j in range(2):
                dim = t * (D // 4) + 4 * st + 2 * j if kv8 else 16 * st + 8 * j + 2 * t
                partner = words[lane ^ 2][st][j] if kv8 else words[lane][st ^ (MT // 2)][j]
                low = t < 2 if kv8 else st < MT // 2
                i = dim & (D // 2 - 1)
                c, s = cs_row[i:i + 2].astype(np.float16), cs_row[D // 2 + i:D // 2 + i + 2].astype(np.float16)
                own, other = h2(words[lane][st][j]), h2(partner)  # numpy fp16: each op rounded, as _rn
                out[g, dim:dim + 2] = own * c - other * s if low else own * c + other * s
                hits[g, dim:dim + 2] += 1
    assert (hits == 1).all()
    return out


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_rope_query_lanes_give_rope_kv_q(D, kv8):
    heads, p = 8, 1234
    qkv = torch.from_numpy(RNG.standard_normal((1, (heads + 2) * D)).astype(np.float16) * 3)  # [1, (8 + 2) D]
    table = rope_table(D, 10000.0, 2048)  # [2048, D]
    want, _, _ = rope_kv_ref(qkv, table, torch.tensor([p]), heads, 1)  # [1, 8, D]
    got = rope_query_lanes(qkv[0, :heads * D].numpy().reshape(heads, D), table[p].numpy(), kv8)
    np.testing.assert_array_equal(got.view(np.uint16), want[0].numpy().view(np.uint16))


# ---------------------------------------------------------------- ptxas report

FUSED_ENTRIES = [f"attn_fused_d{d}{s}{c}" for d in (64, 128) for s in ("", "_kv8", "_kvf8") for c in ("", "_cl")]


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
def test_fused_entries_compile_without_spills(tmp_path):
    """sm_90a, the build layer's options: no stack frame or spills, and the static shared memory the
    launcher budgets for (occupancy and hence the split count depend on it)."""
    cmd = [build.find_nvcc(), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *build.BASE_OPTIONS, "-Xptxas",
           "-v", f"-I{build.KERNEL_DIR}", "-o", str(tmp_path / "a.cubin"),
           str(build.KERNEL_DIR / "attention_fused.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = {}
    for block in re.split(r"Compiling entry function '", proc.stderr)[1:]:
        report[block.split("'")[0]] = block
    for name in FUSED_ENTRIES:
        text = report[name]
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in text, text
        regs = int(re.search(r"Used (\d+) registers", text).group(1))
        smem = int(re.search(r"(\d+) bytes smem", text).group(1))
        assert smem <= FUSED_STATIC_SMEM, (name, smem)
        fp16_d128 = name.startswith("attn_fused_d128") and "_kv" not in name
        assert regs <= (168 if fp16_d128 else 128), (name, regs)  # 3 (4) per SM
