// A warp's 16-channel panel of the engine's int4 layout (awq_layout.cuh) as the register A operand of Hopper's
// wgmma (awq_wgmma.cu: prefill; awq_wgmma_decode.cu: decode batches): a 128-k tile's packed words and terms loaded
// into registers, rearranged to the natural k order, converted to w_hat fragments; and the epilogue both write a
// warpgroup's accumulators with (stmatrix staging, 16-byte rows, residual or SwiGLU).
#pragma once
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

namespace fllama {

constexpr int AWQ_TILE_WORDS = 256;  // the layout's 1 KB panel tile of 128 k

// Four 8x8 fp16 matrices (the thread's registers in mma C layout) stored transposed: lane l gives the
// address of row l % 8 of matrix l / 8 (a row of the transpose: 8 consecutive 16-bit values).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    return h2_bits(__floats2half2_rn(lo, hi));
}

// One 128-k tile of the warp's panel as a lane holds it: rows g (w[0]) and g + 8 (w[1]), and their terms.
struct PanelTile {
    uint4 w[2];
    uint2 term;
};

__device__ __forceinline__ PanelTile load_tile(const uint32_t* packed, const uint32_t* terms, size_t tile,
                                               int lane, bool ok) {
    PanelTile pt;
    const uint32_t* wp = packed + tile * AWQ_TILE_WORDS + lane * 4;
    pt.w[0] = ld_stream(wp, ok);
    pt.w[1] = ld_stream(wp + 128, ok);
    pt.term = ld_cached8(terms + (tile * 8 + (lane >> 2)) * 2, ok);
    return pt;
}

// A row's four words (lane (g, t): k 32 t + 8 w + r of the tile in word w, position r at nibble NIBBLE_OF[r],
// i.e. k pairs (2c, 2c + 1) at nibbles c and c + 4) -> the words of the natural k order: word t' holds k
// 32 t' + 8 w + 2 t + {0, 1} at nibbles w and w + 4, which is what awq_a_frag reads for mma steps 2 t' and
// 2 t' + 1 (k 16 j + {2 t, 2 t + 1, 2 t + 8, 2 t + 9}). Checked against the packing in tests/gpu.
__device__ __forceinline__ uint4 natural_k_words(const uint4& w, int lane) {
    // 1. In-lane 4 x 4 transpose of nibble columns (both 16-bit halves at once): c[n] nibble w = word w nibble n.
    const uint32_t a0 = prmt(w.x, w.z, 0x6240), a2 = prmt(w.x, w.z, 0x7351);  // byte blocks of words 0 | 2
    const uint32_t a1 = prmt(w.y, w.w, 0x6240), a3 = prmt(w.y, w.w, 0x7351);  // of words 1 | 3
    const uint32_t c0 = (a0 & 0x0F0F0F0Fu) | ((a1 << 4) & 0xF0F0F0F0u);
    const uint32_t c1 = ((a0 >> 4) & 0x0F0F0F0Fu) | (a1 & 0xF0F0F0F0u);
    const uint32_t c2 = (a2 & 0x0F0F0F0Fu) | ((a3 << 4) & 0xF0F0F0F0u);
    const uint32_t c3 = ((a2 >> 4) & 0x0F0F0F0Fu) | (a3 & 0xF0F0F0F0u);
    // 2. Column n goes to lane n of the quad: a 4 x 4 word transpose in two butterfly rounds.
    const bool b1 = lane & 2, b0 = lane & 1;
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, b1 ? c0 : c2, 2);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, b1 ? c1 : c3, 2);
    const uint32_t k0 = b1 ? c2 : c0, k1 = b1 ? c3 : c1;
    // u[s][d]: from source lanes with bit 1 = s, for lanes with bit 0 = d
    const uint32_t u00 = b1 ? r0 : k0, u01 = b1 ? r1 : k1, u10 = b1 ? k0 : r0, u11 = b1 ? k1 : r1;
    const uint32_t q0 = __shfl_xor_sync(0xffffffffu, b0 ? u00 : u01, 1);
    const uint32_t q1 = __shfl_xor_sync(0xffffffffu, b0 ? u10 : u11, 1);
    return make_uint4(b0 ? q0 : u00, b0 ? u01 : q0, b0 ? q1 : u10, b0 ? u11 : q1);
}

__device__ __forceinline__ void natural_k(PanelTile& pt, int lane) {
    pt.w[0] = natural_k_words(pt.w[0], lane);
    pt.w[1] = natural_k_words(pt.w[1], lane);
}

// The A fragments of one stage (half `half` of the tile: k16 steps 4 half .. 4 half + 3).
__device__ __forceinline__ void convert_stage(const PanelTile& pt, int half, uint32_t (&a)[4][4]) {
    const AwqTerms tm = awq_terms(pt.term);
    const __half2 s2[2] = {bits_h2(prmt(pt.term.x, pt.term.x, 0x1010)),
                           bits_h2(prmt(pt.term.y, pt.term.y, 0x1010))};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#ifdef FLLAMA_AWQ_TIMING_NO_DEQUANT  // timing only (wrong results): the packed words as the fragments
        const uint32_t wd = word(pt.w[0], ks) ^ word(pt.w[1], ks);
        a[ks][0] = wd;
        a[ks][1] = wd >> 1;
        a[ks][2] = wd >> 2;
        a[ks][3] = wd >> 3;
#else
        awq_a_frag_hat(pt.w, 4 * half + ks, tm, s2, a[ks]);
#endif
    }
}

// A warpgroup's epilogue. d[4 j + 2 h + e] (wgmma's m64 nBT accumulators): channel c0 + 16 w + 8 h + lane / 4 (rows
// g and g + 8 of warp w's panel), token m0 + 8 j + 2 (lane % 4) + e. They are staged transposed by stmatrix in
// shared memory (`stage`, its shared address `stage_addr`: BT rows of AWQ_ROW_PLAIN bytes, AWQ_ROW_SILU with SwiGLU),
// then written as coalesced 16-byte rows of y by the warpgroup's 128 threads (ct: the thread's index among them;
// `bar`: a named barrier of those 128). EPI 0: y [M, N]; 1: + residual (an fp16 add after rounding; y may be the
// residual); 2: y [M, N / 2] = fp16(silu(fp16 gate)) * fp16 up of a gate|up weight interleaved by 8 (rows g: gate
// feature c0 / 2 + 8 w + g, rows g + 8: the same up feature). Rows from rows_here on, channels from N on: not written.
constexpr int AWQ_ROW_PLAIN = 144;  // staging row of 64 channels (128 bytes) + 16: stmatrix conflict-free
constexpr int AWQ_ROW_SILU = 80;    // staging row of 32 features (64 bytes) + 16

template <int EPI, int BT>
__device__ __forceinline__ void awq_store_warpgroup(const float (&d)[BT / 2], unsigned char* stage,
                                                    uint32_t stage_addr, int w, int lane, int ct, int bar,
                                                    __half* y, const __half* residual, int N, int m0,
                                                    int rows_here, int c0) {
    const int mi = lane >> 3, rr = lane & 7;  // the matrix and row whose address this lane gives stmatrix
    if (EPI == 2) {
        // One 8x8 output matrix per token block j. Staging: [BT tokens][32 features of the warpgroup].
#pragma unroll
        for (int q = 0; q < BT / 32; ++q) {
            uint32_t r[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int j = 4 * q + m;
                __half o[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const __half gate = __float2half_rn(d[4 * j + e]);
                    const __half up = __float2half_rn(d[4 * j + 2 + e]);
                    o[e] = __hmul_rn(silu_h(__half2float(gate)), up);
                }
                r[m] = h2_bits(__halves2half2(o[0], o[1]));
            }
            stmatrix_x4_trans(stage_addr + (8 * (4 * q + mi) + rr) * AWQ_ROW_SILU + 16 * w, r[0], r[1], r[2], r[3]);
        }
        named_barrier(bar, 128);
        const int F = N / 2, f0 = c0 / 2;
#pragma unroll 4
        for (int i = 0; i < BT * 4 / 128; ++i) {
            const int id = i * 128 + ct, row = id >> 2, c = id & 3;
            if (row >= rows_here || f0 + 8 * c >= F) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(stage + row * AWQ_ROW_SILU + 16 * c);
            *reinterpret_cast<uint4*>(y + (size_t)(m0 + row) * F + f0 + 8 * c) = v;
        }
    } else {
        // Staging: [BT tokens][64 channels of the warpgroup]; matrix m of call q: j = 2 q + m / 2, h = m % 2.
#pragma unroll
        for (int q = 0; q < BT / 16; ++q) {
            uint32_t r[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int j = 2 * q + (m >> 1), h = m & 1;
                r[m] = pack_h2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            }
            stmatrix_x4_trans(stage_addr + (8 * (2 * q + (mi >> 1)) + rr) * AWQ_ROW_PLAIN + 2 * (16 * w + 8 * (mi & 1)),
                              r[0], r[1], r[2], r[3]);
        }
        named_barrier(bar, 128);
#pragma unroll 4
        for (int i = 0; i < BT * 8 / 128; ++i) {
            const int id = i * 128 + ct, row = id >> 3, c = id & 7;
            if (row >= rows_here || c0 + 8 * c >= N) continue;
            uint4 v = *reinterpret_cast<const uint4*>(stage + row * AWQ_ROW_PLAIN + 16 * c);
            const size_t o = (size_t)(m0 + row) * N + c0 + 8 * c;
            if (EPI == 1) {
                const uint4 res = *reinterpret_cast<const uint4*>(residual + o);
                v.x = h2_bits(__hadd2(bits_h2(v.x), bits_h2(res.x)));
                v.y = h2_bits(__hadd2(bits_h2(v.y), bits_h2(res.y)));
                v.z = h2_bits(__hadd2(bits_h2(v.z), bits_h2(res.z)));
                v.w = h2_bits(__hadd2(bits_h2(v.w), bits_h2(res.w)));
            }
            *reinterpret_cast<uint4*>(y + o) = v;
        }
    }
}

}  // namespace fllama
