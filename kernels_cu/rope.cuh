// RoPE arithmetic shared by rope_kv.cu and the fused decode attention
// (attention_fused.cu, which rotates its own query heads and writes the new token's K/V).
//
// Numerics are transformers' (non-interleaved, rotate_half): the fp32 cos/sin table row of the position is
// rounded to fp16, then for each pair (x1, x2) = (dim i, dim i + d/2), i < d/2, with c = cos[i], s = sin[i]:
//   x1' = x1*c - x2*s,  x2' = x2*c + x1*s,  every multiply and add rounded to fp16 (_rn: no FMA contraction).
// A cache slot holds an fp16 head vector, or its 8-bit codes (int8 or e4m3) with one fp32 scale (kv_codes.cuh's
// rules over the d values).
#pragma once

#include "common.cuh"
#include "kv_codes.cuh"

namespace fllama {

__device__ __forceinline__ __half rope_lo(__half x1, __half x2, __half c, __half s) {
    return __hsub_rn(__hmul_rn(x1, c), __hmul_rn(x2, s));
}

__device__ __forceinline__ __half rope_hi(__half x1, __half x2, __half c, __half s) {
    return __hadd_rn(__hmul_rn(x2, c), __hmul_rn(x1, s));
}

// The cos (or sin) slice [p, p + 8) of a table row as fp16 pairs, each value rounded once.
__device__ __forceinline__ void load_cos_sin_h2(const float* p, __half2 (&out)[4]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = __floats2half2_rn(a.x, a.y); out[1] = __floats2half2_rn(a.z, a.w);
    out[2] = __floats2half2_rn(b.x, b.y); out[3] = __floats2half2_rn(b.z, b.w);
}

// (lo, hi) = dims [8g, 8g + 8) and [d/2 + 8g, d/2 + 8g + 8) of one head rotated in place, their cos / sin
// slices given: the _rn pair ops round each half as rope_lo / rope_hi do (the same bits).
__device__ __forceinline__ void rotate8_h2(Half8& lo, Half8& hi, const __half2 (&c)[4], const __half2 (&s)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 x1 = lo.h[i], x2 = hi.h[i];
        lo.h[i] = __hsub2_rn(__hmul2_rn(x1, c[i]), __hmul2_rn(x2, s[i]));
        hi.h[i] = __hadd2_rn(__hmul2_rn(x2, c[i]), __hmul2_rn(x1, s[i]));
    }
}

// rotate8_h2 with chunk g's slices loaded from the table row cs_row (cos at [0, d/2), sin at [d/2, d)).
__device__ __forceinline__ void rotate8(Half8& lo, Half8& hi, const float* cs_row, int g, int half_d) {
    __half2 c[4], s[4];
    load_cos_sin_h2(cs_row + 8 * g, c);
    load_cos_sin_h2(cs_row + half_d + 8 * g, s);
    rotate8_h2(lo, hi, c, s);
}

// Two table values (cos or sin of dims i, i + 1) rounded to fp16 as the rotation uses them.
__device__ __forceinline__ __half2 cos_sin_half2(float2 f) {
    return __halves2half2(__float2half_rn(f.x), __float2half_rn(f.y));
}

// Two consecutive dims of a head rotated (c, s from cos_sin_half2): `own` holds them, `partner` the dims d/2
// away; low: they are in the first half (x1).
__device__ __forceinline__ __half2 rotate2(__half2 own, __half2 partner, __half2 c, __half2 s, bool low) {
    const __half a0 = __low2half(own), a1 = __high2half(own), b0 = __low2half(partner), b1 = __high2half(partner);
    const __half c0 = __low2half(c), c1 = __high2half(c), s0 = __low2half(s), s1 = __high2half(s);
    if (low) return __halves2half2(rope_lo(a0, b0, c0, s0), rope_lo(a1, b1, c1, s1));
    return __halves2half2(rope_hi(b0, a0, c0, s0), rope_hi(b1, a1, c1, s1));
}

// absmax of a head's chunk (lo, hi), reduced over the G lanes xor-adjacent to this one (the head's chunks;
// G a power of two, every lane of the warp calls it).
__device__ __forceinline__ float head_absmax(const Half8& lo, const Half8& hi, bool active, int G) {
    float m = active ? fmaxf(half8_absmax(lo), half8_absmax(hi)) : 0.0f;
    for (int o = G / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    return m;
}

// Chunk g of a k (is_v false) or v head vector into cache slot `slot` (its d elements at cache + slot * d).
__device__ __forceinline__ void store_head_f16(void* k_cache, void* v_cache, bool is_v, size_t slot, int d,
                                               int half_d, const Half8& lo, const Half8& hi, int g) {
    __half* dst = static_cast<__half*>(is_v ? v_cache : k_cache) + slot * d;
    store_half8(dst + 8 * g, lo);
    store_half8(dst + half_d + 8 * g, hi);
}

// 8-bit codes (KV_I8 or KV_F8): m = the absmax over the whole head (head_absmax); the chunk-0 lane writes the
// slot's scale.
template <int KV>
__device__ __forceinline__ void store_head_q8(void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                                              bool is_v, size_t slot, int d, int half_d, const Half8& lo,
                                              const Half8& hi, float m, int g) {
    float inv, scale;
    kv_scales<KV>(m, inv, scale);
    uint8_t* dst = static_cast<uint8_t*>(is_v ? v_cache : k_cache) + slot * d;
    kv_quantize_store8<KV>(dst + 8 * g, lo, inv);
    kv_quantize_store8<KV>(dst + half_d + 8 * g, hi, inv);
    if (g == 0) (is_v ? v_scale : k_scale)[slot] = scale;
}

}  // namespace fllama
