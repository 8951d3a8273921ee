// FP8 E4M3 quantization of an fp16 matrix [T, K] (an fp8 linear's input), one block per row, by
// model_zoo/quant/fp8.py's rule (fp8_common.cuh):
//   dynamic: a_scale[t] = max(max|x| over the row, 1e-8) / 448
//   static:  a_scale[t] = *static_scale (one fp32 on the device, so a captured graph keeps reading it), written per
//            row as well, so the fp8 GEMMs always read a per-row scale
//   x8 = e4m3(clamp(x * (1 / a_scale), -448, 448)), round to nearest even (IEEE division, no fast math)
// Entry points fp8_quantize_<dyn|static>_nv<NV>(x8 e4m3 [T,K], a_scale f32 [T], static_scale f32 [1] or null,
//                                               x fp16 [T,K], int K); K % 8 == 0, NV * blockDim.x * 8 >= K.
// fp8_quantize_fold: a deferred input (deferred_quant.cuh, int8's format) for the GEMVs of a few rows, below.
#include "fp8_common.cuh"

using namespace fllama;

template <int NV, int QMODE>
__device__ __forceinline__ void fp8_quantize_row(uint8_t* __restrict__ q, float* __restrict__ a_scale,
                                                 const float* __restrict__ static_scale,
                                                 const __half* __restrict__ x, int K) {
    __shared__ float scratch[32];
    const int n_vec = K / 8;
    const size_t row = blockIdx.x;
    const size_t base = row * (size_t)K;
    Half8 v[NV];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) {
            v[j] = load_half8(x + base + 8 * c);
            amax = fmaxf(amax, half8_absmax(v[j]));
        }
    }
    float inv, scale;
    if (QMODE == QUANT_DYNAMIC) {
        fp8_dyn_scales(block_max(amax, scratch), inv, scale);
    } else {
        fp8_static_scales(*static_scale, inv, scale);
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) *reinterpret_cast<uint2*>(q + base + 8 * c) = fp8_quantize_pack8(v[j], inv);
    }
    if (threadIdx.x == 0) a_scale[row] = scale;
}

#define FLLAMA_FP8_QUANTIZE_ENTRY(NAME, NV, QMODE)                                                               \
    extern "C" __global__ void __launch_bounds__(NV == 8 ? 512 : 256)                                           \
        fp8_quantize_##NAME##_nv##NV(uint8_t* q, float* a_scale, const float* static_scale, const __half* x,    \
                                     int K) {                                                                    \
        pdl_enter();                                                                                             \
        fp8_quantize_row<NV, QMODE>(q, a_scale, static_scale, x, K);                                             \
    }

#define FLLAMA_FP8_QUANTIZE_VARIANTS(NV)                  \
    FLLAMA_FP8_QUANTIZE_ENTRY(dyn, NV, QUANT_DYNAMIC)     \
    FLLAMA_FP8_QUANTIZE_ENTRY(static, NV, QUANT_STATIC)

FLLAMA_FP8_QUANTIZE_VARIANTS(1)
FLLAMA_FP8_QUANTIZE_VARIANTS(2)
FLLAMA_FP8_QUANTIZE_VARIANTS(4)
FLLAMA_FP8_QUANTIZE_VARIANTS(8)

// fp8_quantize_fold(x8 e4m3 [T,K], a_scale f32 [T], mx f32 [T,C], sq f32 [T,C] or null, static_scale f32 [1] or
// null, x fp16 [T,K], int K, float eps, int C): x with C partial maxima of each row (attention's units, the SwiGLU
// GEMV's panels: x's own codes, fp8_quantize's bits) or, with sq, an RMSNorm deferred into its producer (x = xg =
// h * w, mx the maxima of |xg| and sq the sums of h^2 per 8 channels: fp8_gemv_fq1's codes and scale). Every block
// of a row reduces all C partials as the one-row GEMVs do (NormRowHook<Fp8Rule>, one fixed order), then quantizes
// its 1024 values: the row spread over ceil(K / 1024) blocks where fp8_quantize gives it one. grid (ceil(K / 1024),
// T), block 256. fp8_quantize_fold_h: the same codes written as their exact fp16 values (x8 fp16 [T,K]), for the
// GEMV that then converts no activation (fp8_gemm.cu's h entries).
template <bool VALUES>
__device__ __forceinline__ void fp8_quantize_fold_row(void* q, float* a_scale, const float* mx, const float* sq,
                                                      const float* static_scale, const __half* x, int K, float eps,
                                                      int C) {
    __shared__ float s_red[8], s_scale;
    pdl_enter();
    const size_t row = blockIdx.y;
    const int c = blockIdx.x * 128 + threadIdx.x;  // threads < 128: this thread's 8-value chunk
    const bool mine = threadIdx.x < 128 && c < K / 8;
    Half8 v;
    if (mine) v = load_half8(x + row * K + 8 * c);  // in flight while the partials are reduced
    float inv;
    const NormQ nq{x + row * K, mx + row * C, sq != nullptr ? sq + row * C : nullptr, static_scale, nullptr, eps, C};
    NormRowHook<Fp8Rule>{&inv, &s_scale, s_red, nq, K, false}();
    if (mine) {
        const size_t o = row * K + 8 * c;
        if constexpr (VALUES) {
            *reinterpret_cast<uint4*>(static_cast<__half*>(q) + o) =
                make_uint4(fp8_fake_quant2(h2_bits(v.h[0]), inv), fp8_fake_quant2(h2_bits(v.h[1]), inv),
                           fp8_fake_quant2(h2_bits(v.h[2]), inv), fp8_fake_quant2(h2_bits(v.h[3]), inv));
        } else {
            *reinterpret_cast<uint2*>(static_cast<uint8_t*>(q) + o) = fp8_quantize_pack8(v, inv);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) a_scale[row] = s_scale;  // thread 0 wrote it
}

#define FLLAMA_FP8_QUANTIZE_FOLD(NAME, VALUES)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        NAME(void* q, float* a_scale, const float* mx, const float* sq, const float* static_scale,               \
             const __half* x, int K, float eps, int C) {                                                         \
        fp8_quantize_fold_row<VALUES>(q, a_scale, mx, sq, static_scale, x, K, eps, C);                           \
    }
FLLAMA_FP8_QUANTIZE_FOLD(fp8_quantize_fold, false)
FLLAMA_FP8_QUANTIZE_FOLD(fp8_quantize_fold_h, true)
