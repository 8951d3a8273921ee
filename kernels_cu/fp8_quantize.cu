// FP8 E4M3 quantization of an fp16 matrix [T, K] (an fp8 linear's input), one block per row, by
// model_zoo/quant/fp8.py's rule (fp8_common.cuh):
//   dynamic: a_scale[t] = max(max|x| over the row, 1e-8) / 448
//   static:  a_scale[t] = *static_scale (one fp32 on the device, so a captured graph keeps reading it), written per
//            row as well, so the fp8 GEMMs always read a per-row scale
//   x8 = e4m3(clamp(x * (1 / a_scale), -448, 448)), round to nearest even (IEEE division, no fast math)
// Entry points fp8_quantize_<dyn|static>_nv<NV>(x8 e4m3 [T,K], a_scale f32 [T], static_scale f32 [1] or null,
//                                               x fp16 [T,K], int K); K % 8 == 0, NV * blockDim.x * 8 >= K.
// fp8_quantize_fold: a deferred input (deferred_quant.cuh, int8's format) for the GEMVs of a few rows, below.
// fp8_rmsnorm_<dyn|static|add_dyn|add_static>_nv<NV>, fp8_silu_mul_<dyn|static>_nv<NV>: rmsnorm.cuh's and
// silu_mul.cuh's rows (int8's prefill kernels) on the fp8 rule, below.
#include "fp8_common.cuh"
#include "rmsnorm.cuh"
#include "silu_mul.cuh"

using namespace fllama;

#define FLLAMA_FP8_QUANTIZE_ENTRY(NAME, NV, QMODE)                                                               \
    extern "C" __global__ void FLLAMA_ROW_BOUNDS(NV)                                                          \
        fp8_quantize_##NAME##_nv##NV(uint8_t* q, float* a_scale, const float* static_scale, const __half* x,    \
                                     int K) {                                                                    \
        pdl_enter();                                                                                             \
        quantize_row<Fp8Rule, NV, QMODE>(q, a_scale, static_scale, x, K);                                        \
    }

#define FLLAMA_FP8_QUANTIZE_VARIANTS(NV)                  \
    FLLAMA_FP8_QUANTIZE_ENTRY(dyn, NV, QUANT_DYNAMIC)     \
    FLLAMA_FP8_QUANTIZE_ENTRY(static, NV, QUANT_STATIC)

FLLAMA_ROW_WIDTHS(FLLAMA_FP8_QUANTIZE_VARIANTS)

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

// The prefill's fused quantizations (fp8_quantize.py's fp8_rmsnorm, fp8_silu_mul): the RMSNorm row (optionally after
// the residual add, residual += x in place) and the SwiGLU row of an interleaved gate|up product, each quantized by
// the fp8 rule in registers: rmsnorm (add_rmsnorm) or silu_mul_interleaved, then fp8_quantize, in one kernel with
// their bits. Arguments as rmsnorm.cu's and silu_mul.cu's entries, q e4m3 codes.
#define FLLAMA_FP8_RMSNORM_ENTRY(NAME, NV, RESIDUAL, QMODE)                                                     \
    extern "C" __global__ void FLLAMA_ROW_BOUNDS(NV)                                                          \
        fp8_rmsnorm_##NAME##_nv##NV(__half* out, uint8_t* q, float* a_scale, const float* static_scale,         \
                                    __half* residual, const __half* x, const __half* w, int H, float eps) {     \
        rmsnorm_row<NV, RESIDUAL, QMODE, Fp8Rule>(out, q, a_scale, static_scale, residual, x, w, H, eps);       \
    }
#define FLLAMA_FP8_SILU_ENTRY(NAME, NV, QMODE)                                                                  \
    extern "C" __global__ void FLLAMA_SILU_BOUNDS(NV)                                                         \
        fp8_silu_mul_##NAME##_nv##NV(uint8_t* q, float* a_scale, const float* static_scale,                     \
                                     const __half* gate_up, int F) {                                             \
        pdl_enter();                                                                                             \
        silu_mul_row<NV, QMODE, Fp8Rule, true>(nullptr, q, a_scale, static_scale, gate_up, F);                   \
    }
#define FLLAMA_FP8_ROW_VARIANTS(NV)                                   \
    FLLAMA_FP8_RMSNORM_ENTRY(dyn, NV, false, QUANT_DYNAMIC)           \
    FLLAMA_FP8_RMSNORM_ENTRY(static, NV, false, QUANT_STATIC)         \
    FLLAMA_FP8_RMSNORM_ENTRY(add_dyn, NV, true, QUANT_DYNAMIC)        \
    FLLAMA_FP8_RMSNORM_ENTRY(add_static, NV, true, QUANT_STATIC)
#define FLLAMA_FP8_SILU_VARIANTS(NV)                                  \
    FLLAMA_FP8_SILU_ENTRY(dyn, NV, QUANT_DYNAMIC)                     \
    FLLAMA_FP8_SILU_ENTRY(static, NV, QUANT_STATIC)

FLLAMA_ROW_WIDTHS(FLLAMA_FP8_ROW_VARIANTS)
FLLAMA_SILU_WIDTHS(FLLAMA_FP8_SILU_VARIANTS)
