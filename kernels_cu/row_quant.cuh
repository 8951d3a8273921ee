// The row kernels' quantization, on either rule (deferred_quant.cuh's Int8Rule, fp8_common.cuh's Fp8Rule): a block
// holds its row as NV 16-byte vectors a thread (vector c = threadIdx.x + j * blockDim.x, n_vec of them), made by
// row_values (a load, a norm, a SwiGLU), and row_quantize_store writes their codes by the row's max (dynamic) or a
// stored value (static). quantize.cu, fp8_quantize.cu, rmsnorm.cuh and silu_mul.cuh share them.
#pragma once

#include "common.cuh"
#include "deferred_quant.cuh"

// The row kernels' widths (NV 16-byte vectors a thread) and block bounds, as kernels_cu/checks.py row_launch picks
// them: up to 256 threads at 1, 2 or 4 vectors, up to 512 at 8. M(NV) instantiates one width's entry points.
#define FLLAMA_ROW_BOUNDS(NV) __launch_bounds__((NV) == 8 ? 512 : 256)
#define FLLAMA_ROW_WIDTHS(M) M(1) M(2) M(4) M(8)

namespace fllama {

// half8_absmax's value in three fp16x2 maxima (__hmax2 returns the other operand of a NaN, and the outer fmaxf maps
// an all-NaN vector to 0 as half8_absmax does), instead of eight conversions and maxima.
__device__ __forceinline__ float half8_absmax_h2(const Half8& v) {
    const __half2 m = __hmax2(__hmax2(__habs2(v.h[0]), __habs2(v.h[1])), __hmax2(__habs2(v.h[2]), __habs2(v.h[3])));
    return fmaxf(0.0f, fmaxf(__low2float(m), __high2float(m)));
}

// The row's vectors v[j] = f(c) for this thread's c < n_vec; returns this thread's max |v|.
template <int NV, typename F>
__device__ __forceinline__ float row_values(Half8 (&v)[NV], int n_vec, F f) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) {
            v[j] = f(c);
            amax = fmaxf(amax, half8_absmax_h2(v[j]));
        }
    }
    return amax;
}

// The row's codes at q_row by Rule's scales of the block's max of amax (QUANT_DYNAMIC) or *static_v (QUANT_STATIC);
// a_scale[row] (when given) by thread 0. scratch: 32 floats of shared memory (block_max).
template <typename Rule, int NV, int QMODE>
__device__ __forceinline__ void row_quantize_store(uint8_t* q_row, const Half8 (&v)[NV], int n_vec, float amax,
                                                   const float* static_v, float* a_scale, size_t row,
                                                   float* scratch) {
    float inv, scale;
    Rule::scales(QMODE == QUANT_DYNAMIC ? block_max(amax, scratch) : *static_v, QMODE == QUANT_STATIC, inv, scale);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) Rule::store8(q_row + 8 * c, v[j], inv);
    }
    if (threadIdx.x == 0 && a_scale != nullptr) a_scale[row] = scale;
}

// Per-token (or static) quantization of row blockIdx.x of an fp16 matrix x [T, K] into q [T, K].
template <typename Rule, int NV, int QMODE>
__device__ __forceinline__ void quantize_row(uint8_t* __restrict__ q, float* __restrict__ a_scale,
                                             const float* __restrict__ static_v, const __half* __restrict__ x,
                                             int K) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x, base = row * (size_t)K;
    Half8 v[NV];
    const float amax = row_values<NV>(v, K / 8, [&](int c) { return load_half8(x + base + 8 * c); });
    row_quantize_store<Rule, NV, QMODE>(q + base, v, K / 8, amax, static_v, a_scale, row, scratch);
}

}  // namespace fllama
