// RMSNorm over rows of fp16 [T, H], optionally after a residual add and optionally quantized to int8.
//
// One block per row. Each thread keeps NV 16-byte vectors of the row in registers, so the row is read
// once. Numerics follow transformers' LlamaRMSNorm exactly in order:
//   s   = residual + x                       (fp16 add; only the add_ variants, written back in place)
//   r   = 1 / sqrt(mean(s32^2) + eps)        (fp32)
//   y   = w * fp16(s32 * r)                  (fp16 multiply)
//   q   = clamp(rint(y * (127 / amax)), +-127), amax = max|y| over the row (dynamic) or a device scalar
//
// The row is rmsnorm.cuh's (fp8_quantize.cu instantiates it on the fp8 rule).
// Entry points: rmsnorm_<variant>_nv<NV>, variant in {plain, dyn, static, add, add_dyn, add_static},
// all with one argument list (unused pointers may be null):
//   (out fp16 [T,H], q int8 [T,H], a_scale f32 [T], static_amax f32 [1], residual fp16 [T,H],
//    x fp16 [T,H], w fp16 [H], int H, float eps)
#include "rmsnorm.cuh"

using namespace fllama;

#define FLLAMA_RMSNORM_ENTRY(NAME, NV, RESIDUAL, QMODE)                                                   \
    extern "C" __global__ void FLLAMA_ROW_BOUNDS(NV)                                                    \
        rmsnorm_##NAME##_nv##NV(__half* out, int8_t* q, float* a_scale, const float* static_amax,          \
                                __half* residual, const __half* x, const __half* w, int H, float eps) {    \
        rmsnorm_row<NV, RESIDUAL, QMODE>(out, reinterpret_cast<uint8_t*>(q), a_scale, static_amax, residual, x, \
                                         w, H, eps);                                                       \
    }

#define FLLAMA_RMSNORM_VARIANTS(NV)                                     \
    FLLAMA_RMSNORM_ENTRY(plain, NV, false, QUANT_NONE)                  \
    FLLAMA_RMSNORM_ENTRY(dyn, NV, false, QUANT_DYNAMIC)                 \
    FLLAMA_RMSNORM_ENTRY(static, NV, false, QUANT_STATIC)               \
    FLLAMA_RMSNORM_ENTRY(add, NV, true, QUANT_NONE)                     \
    FLLAMA_RMSNORM_ENTRY(add_dyn, NV, true, QUANT_DYNAMIC)              \
    FLLAMA_RMSNORM_ENTRY(add_static, NV, true, QUANT_STATIC)

FLLAMA_ROW_WIDTHS(FLLAMA_RMSNORM_VARIANTS)
