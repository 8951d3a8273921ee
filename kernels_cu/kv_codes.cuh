// The KV cache's kinds of element (kernels_cu/kv_codes.py): fp16 values, or 8-bit codes with one fp32 scale per
// head vector (cache slot), value = code * scale. The 8-bit kinds share the cache layout, the scales and every
// kernel's tiling; only the code conversions differ, chosen by the template parameter KV:
//   KV_I8: amax = max(max|x| over d, 1e-8), code = rint(clamp(x * (127 / amax), +-127)), scale = amax / 127
//   KV_F8: scale = max(max|x| over d, 1e-8) / 448, code = e4m3(x * (1 / scale)) (saturate at 448, nearest even)
//          (model_zoo/quant/fp8.py's per-token rule, each head vector a token; fp8_quantize_ref's bits)
// Every e4m3 value is an fp16 value, so both 8-bit kinds turn into exact fp16 mma operands. The e4m3
// conversions need sm_89 (cvt ...e4m3x2): on older GPUs the KV_F8 paths trap, and the launchers refuse an fp8
// cache before any launch (kv_codes.require_kind), so the file still builds for sm_80 with its int8 and fp16 paths.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"
#include "gemm_common.cuh"

namespace fllama {

enum KvKind { KV_F16 = 0, KV_I8 = 1, KV_F8 = 2 };

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define FLLAMA_KV_NO_FP8 1
#endif

// Two codes (the low 16 bits of w, byte i = element i) -> their exact fp16 pair.
__device__ __forceinline__ uint32_t kv_e4m3x2_to_h2(uint32_t w) {
#ifdef FLLAMA_KV_NO_FP8
    __trap();
    return 0u;
#else
    uint32_t out;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(static_cast<uint16_t>(w)));
    return out;
#endif
}

// Four codes (byte i = element i) -> the exact fp16 pairs (0, 1) and (2, 3).
template <int KV>
__device__ __forceinline__ void kv_codes4_to_h2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    if constexpr (KV == KV_F8) {
        lo = kv_e4m3x2_to_h2(w);
        hi = kv_e4m3x2_to_h2(w >> 16);
    } else {
        i8x4_to_h2x2(w, lo, hi);
    }
}

// The quantization of a head vector whose max |x| is amax: inv multiplies each value, scale is stored.
template <int KV>
__device__ __forceinline__ void kv_scales(float amax, float& inv, float& scale) {
    if constexpr (KV == KV_F8) {
        scale = __fdiv_rn(clamp_amax(amax), 448.0f);
        inv = __fdiv_rn(1.0f, scale);
    } else {
        amax_scales(amax, inv, scale);
    }
}

// Two floats -> two e4m3 codes, lo in the low byte (cvt puts its first source in the upper byte).
__device__ __forceinline__ uint32_t kv_e4m3x2(float lo, float hi) {
#ifdef FLLAMA_KV_NO_FP8
    __trap();
    return 0u;
#else
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
#endif
}

// Eight fp16 values times inv -> eight codes stored at p (8-byte aligned; global or shared memory).
template <int KV>
__device__ __forceinline__ void kv_quantize_store8(void* p, const Half8& v, float inv) {
    if constexpr (KV == KV_F8) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(v.h[i]);
            w[i] = kv_e4m3x2(__fmul_rn(f.x, inv), __fmul_rn(f.y, inv));
        }
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
    } else {
        quantize_store8(static_cast<int8_t*>(p), v, inv);
    }
}

}  // namespace fllama
