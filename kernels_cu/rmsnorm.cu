// RMSNorm over rows of fp16 [T, H], optionally after a residual add and optionally quantized to int8.
//
// One block per row. Each thread keeps NV 16-byte vectors of the row in registers, so the row is read
// once. Numerics follow transformers' LlamaRMSNorm exactly in order:
//   s   = residual + x                       (fp16 add; only the add_ variants, written back in place)
//   r   = 1 / sqrt(mean(s32^2) + eps)        (fp32)
//   y   = w * fp16(s32 * r)                  (fp16 multiply)
//   q   = clamp(rint(y * (127 / amax)), +-127), amax = max|y| over the row (dynamic) or a device scalar
//
// Entry points: rmsnorm_<variant>_nv<NV>, variant in {plain, dyn, static, add, add_dyn, add_static},
// all with one argument list (unused pointers may be null):
//   (out fp16 [T,H], q int8 [T,H], a_scale f32 [T], static_amax f32 [1], residual fp16 [T,H],
//    x fp16 [T,H], w fp16 [H], int H, float eps)
#include "common.cuh"

using namespace fllama;

template <int NV, bool RESIDUAL, int QMODE>
__device__ __forceinline__ void rmsnorm_row(__half* __restrict__ out, int8_t* __restrict__ q,
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

    float inv, scale;
    amax_scales(QMODE == QUANT_DYNAMIC ? block_max(amax, scratch) : *static_amax, inv, scale);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) quantize_store8(q + base + 8 * c, v[j], inv);
    }
    if (threadIdx.x == 0 && a_scale != nullptr) a_scale[row] = scale;
}

#define FLLAMA_RMSNORM_ENTRY(NAME, NV, RESIDUAL, QMODE)                                                   \
    extern "C" __global__ void __launch_bounds__(NV == 8 ? 512 : 256)                                                   \
        rmsnorm_##NAME##_nv##NV(__half* out, int8_t* q, float* a_scale, const float* static_amax,          \
                                __half* residual, const __half* x, const __half* w, int H, float eps) {    \
        rmsnorm_row<NV, RESIDUAL, QMODE>(out, q, a_scale, static_amax, residual, x, w, H, eps);            \
    }

#define FLLAMA_RMSNORM_VARIANTS(NV)                                     \
    FLLAMA_RMSNORM_ENTRY(plain, NV, false, QUANT_NONE)                  \
    FLLAMA_RMSNORM_ENTRY(dyn, NV, false, QUANT_DYNAMIC)                 \
    FLLAMA_RMSNORM_ENTRY(static, NV, false, QUANT_STATIC)               \
    FLLAMA_RMSNORM_ENTRY(add, NV, true, QUANT_NONE)                     \
    FLLAMA_RMSNORM_ENTRY(add_dyn, NV, true, QUANT_DYNAMIC)              \
    FLLAMA_RMSNORM_ENTRY(add_static, NV, true, QUANT_STATIC)

FLLAMA_RMSNORM_VARIANTS(1)
FLLAMA_RMSNORM_VARIANTS(2)
FLLAMA_RMSNORM_VARIANTS(4)
FLLAMA_RMSNORM_VARIANTS(8)
