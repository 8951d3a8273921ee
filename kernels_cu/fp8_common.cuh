// FP8 E4M3 helpers of the fp8 kernels (fp8_quantize.cu, fp8_gemm.cu, fp8_wgmma.cu): the activation scales, the
// e4m3 conversions and the W8A8 epilogue, as model_zoo/quant/fp8.py defines them.
//
//   a_scale = max(amax, 1e-8) / 448 (dynamic, per token) or the stored scale (static, per tensor)
//   inv     = 1 / a_scale                 one IEEE division per row, never per element
//   x8      = e4m3(clamp(x * inv, -448, 448)), round to nearest even
//   y       = fp16((acc * a_scale[m]) * w_scale[n])      acc: the fp32 sum of the exact e4m3 products
//
// cvt.rn.satfinite.e4m3x2.f32 saturates to +-448 and rounds to nearest even: the same bits as clamping first and
// torch's .to(float8_e4m3fn). cvt.rn.f16x2.e4m3x2 is exact (every e4m3 value is an fp16 value). Both need sm_89.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"
#include "deferred_quant.cuh"
#include "gemm_common.cuh"

namespace fllama {

constexpr float FP8_MAX = 448.0f;

// The scales of a row whose max |x| is amax (dynamic), or of a stored static scale: inv quantizes, scale is a_scale.
__device__ __forceinline__ void fp8_dyn_scales(float amax, float& inv, float& scale) {
    scale = __fdiv_rn(clamp_amax(amax), FP8_MAX);
    inv = __fdiv_rn(1.0f, scale);
}
__device__ __forceinline__ void fp8_static_scales(float s, float& inv, float& scale) {
    scale = s;
    inv = __fdiv_rn(1.0f, s);
}

// The fp8 rule of deferred_quant.cuh's hooks. A deferred RMSNorm (norm_fold.py) quantizes xg = h * w: dynamic, by
// xg's own max with rstd in a_scale (rstd > 0 cancels in the codes); static, by the stored scale with rstd in inv.
// rstd as int8's fold_scales (norm_fold.cuh's fold_rstd): the fold is not bitwise the norm kernel's path anyway.
struct Fp8Rule {
    __device__ __forceinline__ static void scales(float v, bool is_static, float& inv, float& scale) {
        if (is_static) {
            fp8_static_scales(v, inv, scale);
        } else {
            fp8_dyn_scales(v, inv, scale);
        }
    }
    __device__ __forceinline__ static void fold(float amax, float sum, bool has_norm, const float* static_v, int K,
                                                float eps, float& inv, float& scale) {
        const bool dynamic = static_v == nullptr;
        scales(dynamic ? amax : *static_v, !dynamic, inv, scale);
        if (has_norm) {
            const float rstd = rsqrtf(__fdividef(sum, (float)K) + eps);
            scale = dynamic ? __fmul_rn(scale, rstd) : scale;
            inv = dynamic ? inv : __fmul_rn(inv, rstd);
        }
    }
    __device__ __forceinline__ static void store8(uint8_t* p, const Half8& v, float inv);  // below
};

// Two floats -> two e4m3 codes, lo in the low byte (cvt puts its first source in the upper byte).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

// Eight fp16-valued floats times inv -> eight codes in one 8-byte word (byte i = value i).
__device__ __forceinline__ uint2 fp8_quantize_pack8(const Half8& v, float inv) {
    uint32_t p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(v.h[i]);
        p[i] = e4m3x2(__fmul_rn(f.x, inv), __fmul_rn(f.y, inv));
    }
    return make_uint2(p[0] | (p[1] << 16), p[2] | (p[3] << 16));
}

// Eight fp16 values' codes by inv at p (8-byte aligned): fp8_quantize's, for the row kernels (rmsnorm.cuh,
// silu_mul.cuh).
__device__ __forceinline__ void Fp8Rule::store8(uint8_t* p, const Half8& v, float inv) {
    *reinterpret_cast<uint2*>(p) = fp8_quantize_pack8(v, inv);
}

// Four e4m3 codes (byte i = k i) -> the fp16 pairs (k0, k1) and (k2, k3), exact. Not volatile: the compiler may
// share one conversion between the token tiles of a GEMV step.
__device__ __forceinline__ void e4m3x4_to_h2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

// The same pairs times 2^-8 on the integer pipe (conversions issue at a quarter of its rate): a byte s eeee mmm under
// an fp16 half as s 0eeee mmm0000000 is its e4m3 value times 2^-8 (exponent bias 15 against 7; subnormals alike),
// so PRMT places bytes k0, k1 (k2, k3) at bits 8 and 24, and one shift and two LOP3 move the magnitudes down a bit.
__device__ __forceinline__ uint32_t e4m3x2_bits_scaled(uint32_t v) {  // v: the two bytes at bits 8-15, 24-31
    return lop3<LOP3_AND_OR>(v, 0x80008000u, (v >> 1) & 0x3f803f80u);
}
__device__ __forceinline__ void e4m3x4_to_h2x2_scaled(uint32_t w, uint32_t& lo, uint32_t& hi) {
    lo = e4m3x2_bits_scaled(prmt(w, 0u, 0x1404));
    hi = e4m3x2_bits_scaled(prmt(w, 0u, 0x3424));
}
constexpr float FP8_ALU_UNSCALE = 256.0f;  // 2^8: what the sums of e4m3x4_to_h2x2_scaled's products are short of

// The GEMV epilogue's sum over the block's warps of D register rr of lane l in token tile mt, in warp order.
template <int WARPS, int MT>
__device__ __forceinline__ float warps_sum(const float (&red)[WARPS][MT][4][32], int mt, int rr, int l) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += red[w][mt][rr][l];
    return sum;
}

// The W8A8 epilogue: two fp32 roundings in model_zoo.quant.fp8's order, then fp16; the residual is added after the
// fp16 rounding, as the reference model adds two fp16 tensors.
__device__ __forceinline__ __half fp8_epilogue(float acc, float a_scale, float w_scale, const __half* residual) {
    const __half y = __float2half_rn(__fmul_rn(__fmul_rn(acc, a_scale), w_scale));
    return residual ? __hadd_rn(y, *residual) : y;
}

// The decode GEMV's mma of 8 k's of e4m3 codes: a lane's weight words of rows g / g + 8 (a0, a1: k's 0-3; a2, a3:
// k's 4-7) and its token's codes of the same k's (b0: 0-3, b1: 4-7), each word two exact fp16 pairs, as two
// m16n8k16 fp16 mma with fp32 sums (gemm_common.cuh's fragment layout: A slots (2t, 2t + 1) hold pair (k0, k1),
// slots (2t + 8, 2t + 9) pair (k2, k3); B the same k's). Hopper has no e4m3 mma.sync (ptxas would emulate it the
// same way), and an e4m3 product is exact in the fp16 mma, so this is the contract's fp32 sum of exact products.
// WALU (Fp8MmaAluW): the weights converted on the integer pipe (e4m3x4_to_h2x2_scaled; the activations by cvt), so
// the products and the fp32 sums are Fp8Mma's times 2^-8 exactly (fllama's e4m3 sums never reach fp32's
// subnormals) and the GEMV multiplies them by FP8_ALU_UNSCALE: a third of a 32-row GEMV's conversions moved off
// the conversion unit.
template <bool WALU>
struct Fp8MmaT {
    __device__ __forceinline__ static void weights(uint32_t w, uint32_t& lo, uint32_t& hi) {
        if constexpr (WALU) {
            e4m3x4_to_h2x2_scaled(w, lo, hi);
        } else {
            e4m3x4_to_h2x2(w, lo, hi);
        }
    }
    __device__ __forceinline__ void operator()(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) const {
        uint32_t w0l, w0h, w1l, w1h, xl, xh;
        weights(a0, w0l, w0h);
        weights(a1, w1l, w1h);
        e4m3x4_to_h2x2(b0, xl, xh);
        mma_f16_16816(c, w0l, w1l, w0h, w1h, xl, xh);
        weights(a2, w0l, w0h);
        weights(a3, w1l, w1h);
        e4m3x4_to_h2x2(b1, xl, xh);
        mma_f16_16816(c, w0l, w1l, w0h, w1h, xl, xh);
    }
};
using Fp8Mma = Fp8MmaT<false>;
using Fp8MmaAluW = Fp8MmaT<true>;

// The same mma with the token's values as fp16 (fp8_gemv_xq: x quantized in the loop by Fp8QuantX, whose codes are
// exact fp16 values): x = the 8 halves of k's 0-7, words (k0, k1), (k2, k3), (k4, k5), (k6, k7).
struct Fp8MmaX16 {
    __device__ __forceinline__ void operator()(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               const uint4& x) const {
        uint32_t w0l, w0h, w1l, w1h;
        e4m3x4_to_h2x2(a0, w0l, w0h);
        e4m3x4_to_h2x2(a1, w1l, w1h);
        mma_f16_16816(c, w0l, w1l, w0h, w1h, x.x, x.y);
        e4m3x4_to_h2x2(a2, w0l, w0h);
        e4m3x4_to_h2x2(a3, w1l, w1h);
        mma_f16_16816(c, w0l, w1l, w0h, w1h, x.z, x.w);
    }
};

// An fp16 pair's e4m3 codes by inv, back as the exact fp16 pair of the codes (fp8_quantize's codes, as values).
__device__ __forceinline__ uint32_t fp8_fake_quant2(uint32_t h2, float inv) {
    const float2 f = __half22float2(bits_h2(h2));
    const uint32_t codes = e4m3x2(__fmul_rn(f.x, inv), __fmul_rn(f.y, inv));
    uint32_t out;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(out) : "r"(codes));
    return out;
}

}  // namespace fllama
