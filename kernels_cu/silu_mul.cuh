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

// The SwiGLU rows' widths and register budget (silu_row_launch in checks.py): NV 1 or 2 up to 256 threads, NV 4
// up to 1,024. 56 registers hold a thread's 8 loads in flight without spilling and keep three blocks of LLaMA-2-7B's
// 352-thread rows resident (58, the compiler's choice without a cap, allocates as 64 and leaves two: 15% slower).
#define FLLAMA_SILU_BOUNDS(NV) FLLAMA_SILU_BOUNDS_##NV
#define FLLAMA_SILU_BOUNDS_1 FLLAMA_ROW_BOUNDS(1)
#define FLLAMA_SILU_BOUNDS_2 FLLAMA_ROW_BOUNDS(2)
#define FLLAMA_SILU_BOUNDS_4 __maxnreg__(56)
#define FLLAMA_SILU_WIDTHS(M) M(1) M(2) M(4)

template <int NV, int QMODE, typename Rule = Int8Rule, bool INTERLEAVED = false>
__device__ __forceinline__ void silu_mul_row(__half* __restrict__ out, uint8_t* __restrict__ q,
                                             float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                             const __half* __restrict__ gate_up, int F) {
    __shared__ float scratch[32];
    const int n_vec = F / 8;
    const size_t row = blockIdx.x;
    const __half* gate = gate_up + row * (size_t)(2 * F);
    const __half* up = gate + F;
    // every gate and up load of the thread issued before the first SiLU (volatile asm keeps that order): the
    // row's bytes in flight at once, where load-compute pairs left the SM's memory pipe half idle
    uint4 gr[NV], ur[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        gr[j] = ld_cached(INTERLEAVED ? gate + 16 * c : gate + 8 * c, c < n_vec);
        ur[j] = ld_cached(INTERLEAVED ? gate + 16 * c + 8 : up + 8 * c, c < n_vec);
    }
    Half8 v[NV];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < n_vec) {
            v[j] = silu_mul8(*reinterpret_cast<const Half8*>(&gr[j]), *reinterpret_cast<const Half8*>(&ur[j]));
            if (QMODE == QUANT_NONE) store_half8(out + row * (size_t)F + 8 * c, v[j]);
            amax = fmaxf(amax, half8_absmax_h2(v[j]));
        }
    }
    if (QMODE == QUANT_NONE) return;
    row_quantize_store<Rule, NV, QMODE>(q + row * (size_t)F, v, n_vec, amax, static_amax, a_scale, row, scratch);
}

}  // namespace fllama
