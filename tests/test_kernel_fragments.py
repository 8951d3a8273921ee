"""CPU checks of the register-level tricks in the GEMV / attention kernels, without a GPU.

A small emulator of one warp: PTX's prmt and lop3, fp16 pair arithmetic (numpy float16, round to nearest),
and mma.sync m16n8k16 / m16n8k32 defined by the fragment layouts of the PTX ISA. Each test builds the
lanes' registers exactly as a kernel does from memory (same offsets, same permutes, same magic numbers),
runs the emulated mma, reads the results back with the kernel's output indexing, and compares with an
independent reference. What it proves: the index algebra and the conversion constants; what it cannot:
that the .cu text says the same (the GPU tests do that).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_zoo.quant.awq_pack import dequantize_awq

RNG = np.random.default_rng(0)

# ---------------------------------------------------------------- instruction emulation


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = src[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3_and_or(a: int, b: int, c: int) -> int:  # LUT 0xEA
    return ((a & b) | c) & 0xFFFFFFFF


def h2(u: int) -> np.ndarray:
    """uint32 -> fp16 pair [lo, hi]."""
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)


def u32(h: np.ndarray) -> int:
    v = np.asarray(h, dtype=np.float16).view(np.uint16)
    return int(v[0]) | (int(v[1]) << 16)


def hsub2(a: int, b: int) -> int:
    return u32(h2(a) - h2(b))


def hmul2(a: int, b: int) -> int:
    return u32(h2(a) * h2(b))


def hfma2(a: int, b: int, c: int) -> int:
    exact = h2(a).astype(np.float64) * h2(b).astype(np.float64) + h2(c).astype(np.float64)
    return u32(exact.astype(np.float16))  # one rounding (every use here is exact anyway)


def mma_f16(a: list[list[int]], b: list[list[int]]) -> list[list[float]]:
    """m16n8k16 .row.col, f32 accumulate from 0; a[lane] = 4 regs, b[lane] = 2 regs -> d[lane] = 4 floats."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(2):
            A[g, 2 * t + j] = h2(a[lane][0])[j]
            A[g + 8, 2 * t + j] = h2(a[lane][1])[j]
            A[g, 2 * t + 8 + j] = h2(a[lane][2])[j]
            A[g + 8, 2 * t + 8 + j] = h2(a[lane][3])[j]
            B[2 * t + j, g] = h2(b[lane][0])[j]
            B[2 * t + 8 + j, g] = h2(b[lane][1])[j]
    return _d_fragment(A @ B)


def mma_s8(a: list[list[int]], b: list[list[int]]) -> list[list[float]]:
    """m16n8k32 .row.col s8 x s8 -> s32."""
    def s8(u, j):
        v = (u >> (8 * j)) & 0xFF
        return v - 256 if v >= 128 else v
    A, B = np.zeros((16, 32), dtype=np.int64), np.zeros((32, 8), dtype=np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            A[g, 4 * t + j] = s8(a[lane][0], j)
            A[g + 8, 4 * t + j] = s8(a[lane][1], j)
            A[g, 16 + 4 * t + j] = s8(a[lane][2], j)
            A[g + 8, 16 + 4 * t + j] = s8(a[lane][3], j)
            B[4 * t + j, g] = s8(b[lane][0], j)
            B[16 + 4 * t + j, g] = s8(b[lane][1], j)
    return _d_fragment(A @ B)


def _d_fragment(D: np.ndarray) -> list[list[float]]:
    return [[D[l >> 2, 2 * (l & 3)], D[l >> 2, 2 * (l & 3) + 1], D[(l >> 2) + 8, 2 * (l & 3)],
             D[(l >> 2) + 8, 2 * (l & 3) + 1]] for l in range(32)]


def words_of(buf: np.ndarray, byte_offset: int, n: int) -> list[int]:
    """n little-endian uint32 words of a byte buffer (a 16-byte load when n = 4)."""
    return [int(v) for v in buf[byte_offset:byte_offset + 4 * n].view(np.uint32)]


# ---------------------------------------------------------------- gemm_common.cuh conversions

FP16_1024, FP16_960, SIXTEENTH = 0x64006400, 0x63806380, 0x2C002C00


def awq_zero_terms(zw: int) -> list[int]:
    zz = []
    for p in range(4):
        zm = lop3_and_or(zw >> (4 * p), 0x000F000F, FP16_1024)
        zz.append(hsub2(FP16_960, zm) if p & 1 else zm)
    return zz


def awq_dequant_word(qw: int, zz: list[int], s: list[int]) -> list[int]:
    hi = qw >> 8
    q0 = lop3_and_or(qw, 0x000F000F, FP16_1024)
    q1 = lop3_and_or(qw, 0x00F000F0, FP16_1024)
    q2 = lop3_and_or(hi, 0x000F000F, FP16_1024)
    q3 = lop3_and_or(hi, 0x00F000F0, FP16_1024)
    return [hmul2(hsub2(q0, zz[0]), s[0]), hmul2(hfma2(q1, SIXTEENTH, zz[1]), s[1]),
            hmul2(hsub2(q2, zz[2]), s[2]), hmul2(hfma2(q3, SIXTEENTH, zz[3]), s[3])]


def i8x4_to_h2x2(w: int) -> tuple[int, int]:
    u = w ^ 0x80808080
    return hsub2(prmt(u, 0x64646464, 0x4140), 0x64806480), hsub2(prmt(u, 0x64646464, 0x4342), 0x64806480)


def random_awq(K: int, N: int, G: int):
    qweight = torch.from_numpy(RNG.integers(-2**31, 2**31, (K, N // 8), dtype=np.int64).astype(np.int32))
    qzeros = torch.from_numpy(RNG.integers(-2**31, 2**31, (K // G, N // 8), dtype=np.int64).astype(np.int32))
    scales = torch.from_numpy(RNG.uniform(1e-3, 0.05, (K // G, N)).astype(np.float16))
    return qweight, qzeros, scales


def test_awq_word_conversion_is_bitwise():
    """LOP3 magic numbers + zero terms + fp16 scale == model_zoo.quant.awq_pack.dequantize_awq, every nibble."""
    K, N, G = 32, 64, 32
    qweight, qzeros, scales = random_awq(K, N, G)
    ref = dequantize_awq(qweight, qzeros, scales, G, torch.float16).T.contiguous().numpy()  # [K, N]
    qw, qz, sc = qweight.numpy().view(np.uint32), qzeros.numpy().view(np.uint32), scales.numpy()
    for k in range(K):
        for c in range(N // 8):
            zz = awq_zero_terms(int(qz[k // G, c]))
            s = [u32(sc[k // G, 8 * c + 2 * p: 8 * c + 2 * p + 2]) for p in range(4)]
            pairs = awq_dequant_word(int(qw[k, c]), zz, s)
            got = np.concatenate([h2(v) for v in pairs])  # columns 8c .. 8c + 7
            assert got.view(np.uint16).tolist() == ref[k, 8 * c: 8 * c + 8].view(np.uint16).tolist()


def test_int8_to_fp16_pairs_exact():
    for w in [0, 0x7F80FF01, 0x807F0102, *RNG.integers(0, 2**32, 200).tolist()]:
        lo, hi = i8x4_to_h2x2(int(w))
        want = np.frombuffer(int(w).to_bytes(4, "little"), dtype=np.int8)
        assert np.concatenate([h2(lo), h2(hi)]).astype(np.int64).tolist() == want.astype(np.int64).tolist()


# ---------------------------------------------------------------- one warp of each kernel


def test_awq_gemm_tile():
    """awq_gemm.cu: one warp, one 16-row k tile, 256 columns, 8 tokens."""
    K, N, G, M = 16, 256, 16, 8
    qweight, qzeros, scales = random_awq(K, N, G)
    x = RNG.standard_normal((M, K)).astype(np.float16)
    w_hat = dequantize_awq(qweight, qzeros, scales, G, torch.float16).T.double().numpy()  # [K, N]
    ref = x.astype(np.float64) @ w_hat  # [M, N]
    qbuf, zbuf = qweight.numpy().view(np.uint8).reshape(-1), qzeros.numpy().view(np.uint8).reshape(-1)
    sbuf, xbuf = scales.numpy().view(np.uint8).reshape(-1), x.view(np.uint8).reshape(-1)
    words = N // 8
    out = np.full((M, N), np.nan)
    lanes = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c = 4 * g
        q = [words_of(qbuf, 4 * ((4 * t + r) * words + c), 4) for r in range(4)]
        zw = words_of(zbuf, 4 * c, 4)
        s = [words_of(sbuf, 2 * 8 * (c + w), 4) for w in range(4)]
        xv = words_of(xbuf, 2 * (g * K + 4 * t), 2)
        wh = [[awq_dequant_word(q[r][w], awq_zero_terms(zw[w]), s[w]) for r in range(4)] for w in range(4)]
        lanes.append((wh, xv))
    for w in range(4):
        for p in range(4):
            a = [[prmt(wh[w][0][p], wh[w][1][p], 0x5410), prmt(wh[w][0][p], wh[w][1][p], 0x7632),
                  prmt(wh[w][2][p], wh[w][3][p], 0x5410), prmt(wh[w][2][p], wh[w][3][p], 0x7632)]
                 for wh, _ in lanes]
            d = mma_f16(a, [xv for _, xv in lanes])
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                n = 8 * (4 * g + w) + 2 * p
                out[2 * t, n: n + 2] = d[lane][0], d[lane][2]
                out[2 * t + 1, n: n + 2] = d[lane][1], d[lane][3]
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-9)


GEMV_ROW_BYTES = 4 * 64  # gemm_common.cuh: a stage holds 16 rows of UNROLL = 4 tiles of 64 bytes


def gemv_stage_copies(wbuf: np.ndarray, row_bytes: int, lines: int) -> np.ndarray:
    """gemv_mainloop's cp.async pattern: per line (a pair of tiles) lane copies chunk lane & 7 of rows 2q, 2q + 1,
    8 + 2q, 9 + 2q (q = lane / 8) into the stage, odd rows' chunks at c ^ 4. Checks every quarter-warp's 8 copies
    hit 8 different 16-byte bank groups, and returns the stage."""
    stage = np.zeros(16 * GEMV_ROW_BYTES, dtype=np.uint8)
    for line in range(lines):
        for i in range(4):
            groups = {q: set() for q in range(4)}
            for lane in range(32):
                pair, chunk = 2 * (lane >> 3), lane & 7
                mrow = (0 if i < 2 else 8) + pair + (i & 1)
                dst = mrow * GEMV_ROW_BYTES + 16 * (chunk ^ ((mrow & 1) << 2)) + 128 * line
                src = mrow * row_bytes + 128 * line + 16 * chunk
                stage[dst:dst + 16] = wbuf[src:src + 16]
                groups[lane >> 3].add((dst // 16) % 8)
            assert all(len(g) == 8 for g in groups.values())
    return stage


def gemv_fragment(stage: np.ndarray, lane: int, u: int, hi: bool) -> list[int]:
    """The lane's 16 bytes of tile u of row g (or g + 8) from the stage, as gemv_mainloop's frag() reads them."""
    g, t = lane >> 2, lane & 3
    c = (4 * (u & 1) + t) ^ ((g & 1) << 2)
    return words_of(stage, (g + 8 * hi) * GEMV_ROW_BYTES + 128 * (u >> 1) + 16 * c, 4)


def test_gemv_fragment_reads_are_conflict_free():
    for u in range(4):
        for hi in (False, True):
            for phase in range(4):  # a 16-byte shared load runs as 4 phases of 8 lanes
                lanes = range(8 * phase, 8 * phase + 8)
                offs = [((lane >> 2) + 8 * hi) * GEMV_ROW_BYTES + 128 * (u >> 1)
                        + 16 * ((4 * (u & 1) + (lane & 3)) ^ (((lane >> 2) & 1) << 2)) for lane in lanes]
                assert len({(o // 16) % 8 for o in offs}) == 8


@pytest.mark.parametrize("kind", ["int8", "fp16"])
def test_gemv_tile(kind):
    """int8_gemm.cu / fp16_gemv.cu: one warp, 16 channels, one line of every row (two k tiles of 64 bytes of int8
    or 32 halves) through the shared-memory stage, against the product."""
    int8 = kind == "int8"
    K = 128 if int8 else 64
    if int8:
        W = RNG.integers(-127, 128, (16, K)).astype(np.int8)
        X = RNG.integers(-127, 128, (8, K)).astype(np.int8)
    else:
        W = RNG.standard_normal((16, K)).astype(np.float16)
        X = RNG.standard_normal((8, K)).astype(np.float16)
    ref = X.astype(np.float64) @ W.astype(np.float64).T  # [8 tokens, 16 channels]
    wbuf, xbuf = W.view(np.uint8).reshape(-1), X.view(np.uint8).reshape(-1)
    row_bytes = K * W.itemsize
    stage = gemv_stage_copies(wbuf, row_bytes, 1)
    acc = [[0.0] * 4 for _ in range(32)]
    for u in range(2):
        for s in range(2):
            a, b = [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                wl, wh = gemv_fragment(stage, lane, u, False), gemv_fragment(stage, lane, u, True)
                assert wl == words_of(wbuf, g * row_bytes + 64 * u + 16 * t, 4)  # what a direct load would give
                xv = words_of(xbuf, g * row_bytes + 64 * u + 16 * t, 4)
                a.append([wl[2 * s], wh[2 * s], wl[2 * s + 1], wh[2 * s + 1]])
                b.append([xv[2 * s], xv[2 * s + 1]])
            d = (mma_s8 if int8 else mma_f16)(a, b)
            acc = [[acc[l][r] + d[l][r] for r in range(4)] for l in range(32)]
    out = np.full((8, 16), np.nan)
    for l in range(32):  # the epilogue's indexing: n = l/4 (+8 for r >= 2), m = 2(l%4) + (r & 1)
        for r in range(4):
            out[2 * (l & 3) + (r & 1), (l >> 2) + (8 if r >= 2 else 0)] = acc[l][r]
    np.testing.assert_allclose(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("D", [64, 128])
def test_attention_fragments(D):
    """attention_decode.cu / attention_stage.cuh: scores S = K Q^T for 16 positions x 8 heads, then O^T = V^T P^T."""
    Kc = RNG.standard_normal((16, D)).astype(np.float16)
    Q = RNG.standard_normal((8, D)).astype(np.float16)
    kbuf, qbuf = Kc.view(np.uint8).reshape(-1), Q.view(np.uint8).reshape(-1)
    QV = D // 32
    S = [[0.0] * 4 for _ in range(32)]
    for st in range(D // 16):
        i, w = st // 2, 2 * (st % 2)
        a, b = [], []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            kl = words_of(kbuf, 2 * (g * D + t * (D // 4) + 8 * i), 4)
            kh = words_of(kbuf, 2 * ((g + 8) * D + t * (D // 4) + 8 * i), 4)
            qf = words_of(qbuf, 2 * (g * D + t * (D // 4) + 8 * i), 4)
            a.append([kl[w], kh[w], kl[w + 1], kh[w + 1]])
            b.append([qf[w], qf[w + 1]])
        d = mma_f16(a, b)
        S = [[S[l][r] + d[l][r] for r in range(4)] for l in range(32)]
    scores = np.full((8, 16), np.nan)  # [head, position] as the kernel stores sc[2t(+1)][g(+8)]
    for l in range(32):
        g, t = l >> 2, l & 3
        scores[2 * t, g], scores[2 * t + 1, g] = S[l][0], S[l][1]
        scores[2 * t, g + 8], scores[2 * t + 1, g + 8] = S[l][2], S[l][3]
    assert QV * 32 == D
    np.testing.assert_allclose(scores, Q.astype(np.float64) @ Kc.astype(np.float64).T, rtol=1e-9, atol=1e-9)

    V = RNG.standard_normal((16, D)).astype(np.float16)
    P = RNG.uniform(0, 1, (8, 16)).astype(np.float16)  # ph[head][position]
    vbuf, pbuf = V.view(np.uint8).reshape(-1), P.view(np.uint8).reshape(-1)
    out = np.full((8, D), np.nan)
    for i in range(D // 64):
        for jp in range(4):
            a, b = [], []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                v = [words_of(vbuf, 2 * ((4 * t + r) * D + 8 * (g + 8 * i)), 4) for r in range(4)]
                a.append([prmt(v[0][jp], v[1][jp], 0x5410), prmt(v[0][jp], v[1][jp], 0x7632),
                          prmt(v[2][jp], v[3][jp], 0x5410), prmt(v[2][jp], v[3][jp], 0x7632)])
                b.append(words_of(pbuf, 2 * (g * 16 + 4 * t), 2))
            d = mma_f16(a, b)
            for l in range(32):  # the reduction's indexing: d = 8(g + 8i) + 2jp + (r >> 1), slot 2t + (r & 1)
                for r in range(4):
                    dim = 8 * ((l >> 2) + 8 * i) + 2 * jp + (r >> 1)
                    out[2 * (l & 3) + (r & 1), dim] = d[l][r]
    np.testing.assert_allclose(out, P.astype(np.float64) @ V.astype(np.float64), rtol=1e-9, atol=1e-9)
