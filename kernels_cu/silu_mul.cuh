// The SwiGLU row of silu_mul.cu (int8) and fp8_quantize.cu (fp8), templated on the quantization rule
// (deferred_quant.cuh's Int8Rule, fp8_common.cuh's Fp8Rule) and the column order of gate_up [T, 2F]: gate = columns
// [0, F), up = [F, 2F), or INTERLEAVED (swiglu_layout.py: 16-column panels of 8 gate then 8 up channels, panel c
// giving outputs 8c..8c+7). One block per row, the row's outputs in registers. silu in fp32 rounded to fp16, then an
// fp16 multiply (torch's F.silu(g) * u on fp16); the codes are those of that fp16 value by quantize.cu's or
// fp8_quantize.cu's rule: the bits of silu_mul (or silu_mul_interleaved) followed by the quantize kernel.
#pragma once

#include "common.cuh"
#include "row_quant.cuh"
#include "silu_fast.cuh"

namespace fllama {

template <int NV, int QMODE, typename Rule = Int8Rule, bool INTERLEAVED = false>
__device__ __forceinline__ void silu_mul_row(__half* __restrict__ out, uint8_t* __restrict__ q,
                                             float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                             const __half* __restrict__ gate_up, int F) {
    __shared__ float scratch[32];
    const int n_vec = F / 8;
    const size_t row = blockIdx.x;
    const __half* gate = gate_up + row * (size_t)(2 * F);
    const __half* up = gate + F;
    Half8 v[NV];
    const float amax = row_values<NV>(v, n_vec, [&](int c) {
        const Half8 g = load_half8(INTERLEAVED ? gate + 16 * c : gate + 8 * c);
        const Half8 u = load_half8(INTERLEAVED ? gate + 16 * c + 8 : up + 8 * c);
        const Half8 s = silu_mul8(g, u);
        if (QMODE == QUANT_NONE) store_half8(out + row * (size_t)F + 8 * c, s);
        return s;
    });
    if (QMODE == QUANT_NONE) return;
    row_quantize_store<Rule, NV, QMODE>(q + row * (size_t)F, v, n_vec, amax, static_amax, a_scale, row, scratch);
}

}  // namespace fllama
