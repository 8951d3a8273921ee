// Lab only: the fp8 prefill's row kernels (SwiGLU codes, the residual RMSNorm's codes, plain quantization) at other
// widths and register budgets, to find where they reach the copy rate. Same templates as the product entries, so the
// bits must equal theirs.
#include "fp8_common.cuh"
#include "rmsnorm.cuh"
#include "silu_mul.cuh"

using namespace fllama;


#define SILU_V(NV, T, B)                                                                                     \
    extern "C" __global__ void __launch_bounds__(T, B) silu_nv##NV##_t##T##_b##B(                            \
        uint8_t* q, float* a_scale, const float* s, const __half* gu, int F) {                               \
        silu_mul_row<NV, QUANT_DYNAMIC, Fp8Rule, true>(nullptr, q, a_scale, s, gu, F);                       \
    }
SILU_V(8, 192, 1) SILU_V(8, 192, 3) SILU_V(8, 192, 4) SILU_V(8, 192, 5)
SILU_V(4, 352, 1) SILU_V(4, 352, 2) SILU_V(4, 352, 3) SILU_V(4, 352, 4)
SILU_V(2, 704, 1) SILU_V(2, 704, 2)

#define NORM_V(NV, T, B)                                                                                     \
    extern "C" __global__ void __launch_bounds__(T, B) norm_nv##NV##_t##T##_b##B(                            \
        __half* out, uint8_t* q, float* a_scale, const float* s, __half* residual, const __half* x,          \
        const __half* w, int H, float eps) {                                                                 \
        rmsnorm_row<NV, true, QUANT_DYNAMIC, Fp8Rule>(out, q, a_scale, s, residual, x, w, H, eps);           \
    }
NORM_V(1, 512, 1) NORM_V(1, 512, 3) NORM_V(2, 256, 1) NORM_V(2, 256, 6) NORM_V(4, 128, 1) NORM_V(4, 128, 8)
NORM_V(8, 64, 1) NORM_V(8, 64, 16)

#define QUANT_V(NV, T, B)                                                                                    \
    extern "C" __global__ void __launch_bounds__(T, B) quant_nv##NV##_t##T##_b##B(                           \
        uint8_t* q, float* a_scale, const float* s, const __half* x, int K) {                                \
        quantize_row<Fp8Rule, NV, QUANT_DYNAMIC>(q, a_scale, s, x, K);                                       \
    }
QUANT_V(1, 512, 1) QUANT_V(1, 512, 3) QUANT_V(2, 256, 1) QUANT_V(2, 256, 6) QUANT_V(4, 128, 1) QUANT_V(4, 128, 8)
QUANT_V(8, 64, 1) QUANT_V(8, 64, 16)
