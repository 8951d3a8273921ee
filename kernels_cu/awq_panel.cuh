// A warp's 16-channel panel of the engine's int4 layout (awq_layout.cuh) as the register A operand of Hopper's
// wgmma (awq_wgmma.cu: prefill; awq_wgmma_decode.cu: decode batches): a 128-k tile's packed words and terms loaded
// into registers, rearranged to the natural k order, converted to w_hat fragments; and the stmatrix store both
// epilogues stage their accumulators with.
#pragma once
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"

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

}  // namespace fllama
