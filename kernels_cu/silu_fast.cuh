// silu_h's bits for less work (docs/gpu.md, "Fast SiLU"). silu_h's input is an fp16 value and its output is rounded to
// fp16, so a cheaper fp32 quotient q with a proven bound |q / q_ref - 1| <= eps gives silu_h's fp16 whenever
// q (1 - eps) and q (1 + eps) round to the same fp16 (rounding is monotone); the rare others take silu_h.
// tests/gpu/test_silu_mul.py checks all 65,536 inputs.
#pragma once

#include "common.cuh"

namespace fllama {

__device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float rcp_approx_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The bound from documented maxima (PTX ISA: ex2.approx 2 ulp, rcp.approx 1 ulp; CUDA guide: expf 2 ulp) and the
// fp32 roundings: eps(g) = 5 * 2^-23 + 7 * 2^-24 + |g| * 7.3e-8 (t's rounding and log2(e)'s) + 2^-24 (the bracket's
// own rounding), taken as EPS_0 + EPS_G |g|.
constexpr float SILU_EPS_0 = 1.1e-6f;
constexpr float SILU_EPS_G = 7.4e-8f;
constexpr float NEG_LOG2E = -1.4426950408889634f;

// g / (1 + 2^(-g log2 e)) by ex2.approx and rcp.approx.
__device__ __forceinline__ float silu_q_approx(float g) {
    return __fmul_rn(g, rcp_approx_ftz(__fadd_rn(1.0f, ex2_approx_ftz(__fmul_rn(g, NEG_LOG2E)))));
}

// silu_h(g)'s bits when slow < 2^16 (else the caller takes silu_h): both ends of q's interval as one fp16 pair, whose
// bits b give b - (b << 16) < 2^16 exactly when the halves are equal; a zero of the wrong sign (g = -0, or g < -87
// where the ftz reciprocal is 0), NaN ends or an fp16 boundary inside the interval leave it >= 2^16.
__device__ __forceinline__ __half silu_h_fast(float g, uint32_t& slow) {
    const float q = silu_q_approx(g), eps = __fmaf_rn(fabsf(g), SILU_EPS_G, SILU_EPS_0);
    const __half2 h = __floats2half2_rn(__fmaf_rn(-q, eps, q), __fmaf_rn(q, eps, q));
    slow = *reinterpret_cast<const uint32_t*>(&h) * 0xffff0001u;
    return __low2half(h);
}

// Eight fp16(silu(g)) * u with silu_h's bits: the fast path for all eight (straight-line code the compiler
// interleaves; one fp16x2 multiply a pair, each half rounded as __hmul_rn), then silu_h for the rare slow ones.
__device__ __forceinline__ Half8 silu_mul8(const Half8& g, const Half8& u) {
    Half8 s;
    uint32_t slow[8], any = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 gk = __half22float2(g.h[k]);
        const __half lo = silu_h_fast(gk.x, slow[2 * k]), hi = silu_h_fast(gk.y, slow[2 * k + 1]);
        s.h[k] = __hmul2_rn(__halves2half2(lo, hi), u.h[k]);
        any |= slow[2 * k] | slow[2 * k + 1];
    }
    if (any >= 0x10000u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (slow[i] >= 0x10000u) half8_set(s, i, __hmul_rn(silu_h(half8_get(g, i)), half8_geth(u, i)));
        }
    }
    return s;
}

}  // namespace fllama
