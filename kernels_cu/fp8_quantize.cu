// FP8 E4M3 quantization of an fp16 matrix [T, K] (an fp8 linear's input), one block per row, by
// model_zoo/quant/fp8.py's rule (fp8_common.cuh):
//   dynamic: a_scale[t] = max(max|x| over the row, 1e-8) / 448
//   static:  a_scale[t] = *static_scale (one fp32 on the device, so a captured graph keeps reading it), written per
//            row as well, so the fp8 GEMMs always read a per-row scale
//   x8 = e4m3(clamp(x * (1 / a_scale), -448, 448)), round to nearest even (IEEE division, no fast math)
// Entry points fp8_quantize_<dyn|static>_nv<NV>(x8 e4m3 [T,K], a_scale f32 [T], static_scale f32 [1] or null,
//                                               x fp16 [T,K], int K); K % 8 == 0, NV * blockDim.x * 8 >= K.
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
