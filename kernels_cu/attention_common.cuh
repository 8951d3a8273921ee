// What the two decode-attention kernels share (attention_decode.cu, attention_fused.cu): the mma's 8 query-head
// slots and the 8-bit V's dequantization.
#pragma once

#include "common.cuh"
#include "gemm_common.cuh"
#include "rope.cuh"

namespace fllama {

constexpr int SLOTS = 8;  // query heads per block: the mma N dimension

// 8-bit V: dequantize to fp16 once per element (value = code * scale, fp32 product, one rounding).
__device__ __forceinline__ uint32_t scale2(uint32_t h2, float s) {
    const float2 f = __half22float2(bits_h2(h2));
    return h2_bits(__floats2half2_rn(f.x * s, f.y * s));
}
__device__ __forceinline__ uint4 scale8(uint4 v, float s) {
    return make_uint4(scale2(v.x, s), scale2(v.y, s), scale2(v.z, s), scale2(v.w, s));
}

}  // namespace fllama
