// The engine's int4 layout (awq_gemv.py packs it; awq_gemv.cu and awq_batch.cu read it): the pieces both
// kernels share to turn a lane's weight words and group terms into m16n8k16 A fragments.
//   A 128-k tile of a 16-channel panel is 1 KB: [h = row g | row g + 8][lane][4 words]; lane (g, t)'s word w
//   feeds mma 2w (its low byte pairs) and 2w + 1 (after >> 8), nibbles placed so that each LOP3 extraction is
//   an A register as it comes. Per (channel, group run) one uint32 of terms: fp16 s | fp16 1024 + z << 16.
#pragma once
#include "common.cuh"
#include "gemm_common.cuh"

namespace fllama {

// Lane's two group terms (rows g and g + 8) -> the zero pairs that make q - z exact and the fp32 scales.
struct AwqTerms {
    __half2 zlo[2];  // 1024 + z: subtracted from (1024 + q)
    __half2 zhi[2];  // 960 - (1024 + z) = -(64 + z): added to (1024 + 16 q) / 16 = 64 + q
    float s[2];
};

__device__ __forceinline__ AwqTerms awq_terms(uint2 raw) {
    AwqTerms tm;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t v = h ? raw.y : raw.x;
        tm.zlo[h] = bits_h2(prmt(v, v, 0x3232));  // both halves = the high half (1024 + z)
        tm.zhi[h] = __hsub2(bits_h2(FP16_960), tm.zlo[h]);
        tm.s[h] = __half2float(__ushort_as_half((unsigned short)(v & 0xffff)));
    }
    return tm;
}

// The A fragment of mma j (0..7) of a tile from the lane's words w[h] (rows g, g + 8): q - z, exact in fp16
// (the magic-number subtraction; the group's scale multiplies the mma's fp32 sum instead).
//   a0 row g (e0, e1), a1 row g + 8, a2 row g (e2, e3), a3 row g + 8
__device__ __forceinline__ void awq_a_frag(const uint4 (&w)[2], int j, const AwqTerms& tm, uint32_t (&a)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t wd = word(w[h], j >> 1) >> ((j & 1) * 8);
        a[h] = h2_bits(__hsub2(bits_h2(lop3<LOP3_AND_OR>(wd, 0x000f000f, FP16_1024)), tm.zlo[h]));
        a[2 + h] = h2_bits(__hfma2(bits_h2(lop3<LOP3_AND_OR>(wd, 0x00f000f0, FP16_1024)),
                                   bits_h2(FP16_ONE_SIXTEENTH), tm.zhi[h]));
    }
}

// The same fragment as w_hat = fp16((q - z) * s), the register A operand of awq_wgmma.cu's wgmma: bit for bit
// awq_w_hat8 (q - z exact, one rounding in the product). s2[h]: row h's scale in both halves.
__device__ __forceinline__ void awq_a_frag_hat(const uint4 (&w)[2], int j, const AwqTerms& tm,
                                               const __half2 (&s2)[2], uint32_t (&a)[4]) {
    uint32_t qz[4];
    awq_a_frag(w, j, tm, qz);
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = h2_bits(__hmul2_rn(bits_h2(qz[r]), s2[r & 1]));
}

// acc += s * tmp for one group's mma sums of MT token tiles (c0, c1: row g, scale s[0]; c2, c3: row g + 8).
template <int MT>
__device__ __forceinline__ void awq_scale_add(float (&acc)[MT][4], const float (&tmp)[MT][4], const AwqTerms& tm) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        acc[mt][0] = fmaf(tm.s[0], tmp[mt][0], acc[mt][0]);
        acc[mt][1] = fmaf(tm.s[0], tmp[mt][1], acc[mt][1]);
        acc[mt][2] = fmaf(tm.s[1], tmp[mt][2], acc[mt][2]);
        acc[mt][3] = fmaf(tm.s[1], tmp[mt][3], acc[mt][3]);
    }
}

// w_hat = fp16((q - z) * s) of the 8 values one packed word holds (positions 0-7 of a lane's run: the word's
// two mma runs of 4 k), bit for bit model_zoo.quant.awq_pack.dequantize_awq: q - z exact by the magic numbers,
// one fp16 rounding in the product with s. `term` is the group's word (fp16 s | fp16 1024 + z << 16).
__device__ __forceinline__ uint4 awq_w_hat8(uint32_t wd, uint32_t term) {
    const __half2 zlo = bits_h2(prmt(term, term, 0x3232));
    const __half2 zhi = __hsub2(bits_h2(FP16_960), zlo);
    const __half2 s = bits_h2(prmt(term, term, 0x1010));
    uint32_t o[4];
#pragma unroll
    for (int d = 0; d < 2; ++d) {
        const uint32_t wdd = wd >> (d * 8);
        o[2 * d] = h2_bits(__hmul2_rn(__hsub2(bits_h2(lop3<LOP3_AND_OR>(wdd, 0x000f000f, FP16_1024)), zlo), s));
        o[2 * d + 1] = h2_bits(__hmul2_rn(__hfma2(bits_h2(lop3<LOP3_AND_OR>(wdd, 0x00f000f0, FP16_1024)),
                                                  bits_h2(FP16_ONE_SIXTEENTH), zhi), s));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace fllama
