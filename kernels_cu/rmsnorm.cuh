// The RMSNorm row of rmsnorm.cu (int8) and fp8_quantize.cu (fp8), templated on the quantization rule
// (deferred_quant.cuh's Int8Rule, fp8_common.cuh's Fp8Rule): one block per row, the row in registers. In order:
//   s   = residual + x                       (fp16 add; RESIDUAL only, written back in place)
//   r   = 1 / sqrt(mean(s32^2) + eps)        (fp32)
//   y   = w * fp16(s32 * r)                  (fp16 multiply)
//   q   = Rule's codes of y by the row's max |y| (dynamic) or a stored value (static), a_scale Rule's scale
// The codes are those of the norm kernel's fp16 output quantized by quantize.cu / fp8_quantize.cu: the same bits.
#pragma once

#include "common.cuh"
#include "row_quant.cuh"

namespace fllama {

template <int NV, bool RESIDUAL, int QMODE, typename Rule = Int8Rule>
__device__ __forceinline__ void rmsnorm_row(__half* __restrict__ out, uint8_t* __restrict__ q,
                                            float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                            __half* __restrict__ residual, const __half* __restrict__ x,
                                            const __half* __restrict__ w, int H, float eps) {
    __shared__ float scratch[32];
    const int n_vec = H / 8;
    const size_t row = blockIdx.x;
    const size_t base = row * (size_t)H;
    // the norm weight depends on no earlier kernel: loaded before the PDL wait, it is no L2 round trip between
    // the two reductions
    Half8 wv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) wv[j] = load_half8(w + 8 * c);
    }
    pdl_enter();
    Half8 v[NV];
    float sumsq = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) {
            v[j] = load_half8(x + base + 8 * c);
            if (RESIDUAL) {
                Half8 r = load_half8(residual + base + 8 * c);
#pragma unroll
                for (int i = 0; i < 4; ++i) v[j].h[i] = __hadd2_rn(r.h[i], v[j].h[i]);
                store_half8(residual + base + 8 * c, v[j]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float f = half8_get(v[j], i);
                sumsq = __fmaf_rn(f, f, sumsq);
            }
        }
    }
    const float total = block_sum(sumsq, scratch);
    const float rinv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)H), eps)));

    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const __half normed = __float2half_rn(__fmul_rn(half8_get(v[j], i), rinv));
                half8_set(v[j], i, __hmul_rn(half8_geth(wv[j], i), normed));
            }
            if (QMODE == QUANT_NONE) {
                store_half8(out + base + 8 * c, v[j]);
            } else {
                amax = fmaxf(amax, half8_absmax(v[j]));
            }
        }
    }
    if (QMODE == QUANT_NONE) return;
    row_quantize_store<Rule, NV, QMODE>(q + base, v, n_vec, amax, static_amax, a_scale, row, scratch);
}

}  // namespace fllama
