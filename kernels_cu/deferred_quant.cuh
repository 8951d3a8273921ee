// The deferred quantization of one decode row, shared by the int8 and fp8 GEMVs (int8_gemm.cu, fp8_gemm.cu): the
// pieces that find a row's scales from what the kernel before wrote, and the epilogue pieces that write them for the
// kernel after. A Rule turns a max (or a static value) into (inv, scale) and stores codes: Int8Rule here
// (quantize.cu's), Fp8Rule in fp8_common.cuh; the row kernels of rmsnorm.cuh and silu_mul.cuh take them too.
//
//   XqRowHook   the row's max from C partial maxima (attention's units) or the row max itself (the SwiGLU GEMV's
//               atomic max), or a static value: no read of the row, no barrier
//   NormRowHook a deferred RMSNorm's scales (norm_fold.py) from its producer's sums of h^2 and maxima of |xg|
//   fold8_*     the producer side of that norm: xg = h * w, sums and maxima per 8 channels (Int8Fold)
//   swiglu_amax_store  the SwiGLU epilogue's maxima per 8 channels and the row's atomic max
#pragma once

#include "common.cuh"
#include "gemm_common.cuh"

namespace fllama {

// Up to 8 rows' per-thread maxima a[r] reduced over each warp, stored for the block's cross-warp pass at
// s_red[r * WARPS + warp]; rows is block-uniform.
template <int WARPS>
__device__ __forceinline__ void warp_rows_max_store(const float (&a)[8], int rows, float* s_red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        if (r >= rows) break;
        const float m = warp_max(a[r]);
        if (lane == 0) s_red[r * WARPS + warp] = m;
    }
}

struct Int8Rule {
    // is_static: v is the stored static value (int8: an amax, the same expression)
    __device__ __forceinline__ static void scales(float v, bool, float& inv, float& scale) {
        amax_scales(v, inv, scale);
    }
    __device__ __forceinline__ static void fold(float amax, float sum, bool has_norm, const float* static_v, int K,
                                                float eps, float& inv, float& scale) {
        fold_scales(amax, sum, has_norm, static_v, K, eps, inv, scale);
    }
    // eight fp16 values' codes by inv, stored at p (8-byte aligned): the row kernels' (rmsnorm.cuh, silu_mul.cuh)
    __device__ __forceinline__ static void store8(uint8_t* p, const Half8& v, float inv) {
        quantize_store8(reinterpret_cast<int8_t*>(p), v, inv);
    }
};

// One row's scales (the batch-1 decode step's o_proj / down_proj): every warp finds them itself, no barrier.
template <typename Rule>
struct XqRowHook {
    float* inv;      // the warp's quantizing factor (a local of the kernel: registers after inlining)
    float* s_scale;  // [1] a_scale for the epilogue, written by thread 0
    const float* part;
    const float* static_v;
    const float* row_amax;
    int C, m0;

    __device__ __forceinline__ void operator()() const {
        float amax;
        if (row_amax != nullptr) {
            amax = row_amax[m0];
        } else if (part != nullptr) {
            amax = 0.0f;
            for (int i = threadIdx.x & 31; i < C; i += 32) amax = fmaxf(amax, part[(size_t)m0 * C + i]);
            amax = warp_max(amax);
        } else {
            amax = *static_v;
        }
        float scale;
        Rule::scales(amax, row_amax == nullptr && part == nullptr, *inv, scale);
        if (threadIdx.x == 0) *s_scale = scale;
    }
};

// A deferred RMSNorm of one row as its consumer GEMV reads it: xg fp16 [1, K] = h * w and its C partial maxima mx
// (of |xg|) and sums of h^2 sq (null: no norm), as an Int8Fold producer wrote them; static_v: the static value or
// null; zero: set to 0 by the first block (a later SwiGLU GEMV's row max).
struct NormQ {
    const __half* xg;
    const float* mx;
    const float* sq;
    const float* static_v;
    float* zero;
    float eps;
    int C;
};

// The partials reduced as quantize.cu's quantize_fold does, in its order (virtual threads v < 128 sum sq[v],
// sq[v + 128], ... in turn, then a butterfly per warp of 32, then the four warps in order: the same float), so the
// scales are quantize_fold's bits. zero is cleared by the first block: the down_proj before, its last reader, has
// completed at this wait, and its writer runs after this kernel.
template <typename Rule>
struct NormRowHook {
    float* inv;      // the thread's quantizing factor
    float* s_scale;  // [1] a_scale for the epilogue, written by thread 0
    float* s_red;    // [8]: the sums of warps 0-3, the maxima of warps 4-7
    NormQ nq;
    int K;
    bool first;  // the grid's first block

    __device__ __forceinline__ void operator()() const {
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, v = tid & 127;
        if (nq.zero != nullptr && first && tid == 0) nq.zero[0] = 0.0f;
        float r = 0.0f;
        // unrolled, so that the loads go out at once (C = K / 8 = 512 for LLaMA-2-7B: 4 a thread); the adds stay
        // in order
        if (tid < 128) {
            if (nq.sq != nullptr) {
#pragma unroll 4
                for (int i = v; i < nq.C; i += 128) r += nq.sq[i];
            }
            r = warp_sum(r);
        } else {
            if (nq.static_v == nullptr) {
#pragma unroll 4
                for (int i = v; i < nq.C; i += 128) r = fmaxf(r, nq.mx[i]);
            }
            r = warp_max(r);
        }
        if (lane == 0) s_red[warp] = r;
        __syncthreads();
        float amax = 0.0f, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            amax = fmaxf(amax, s_red[4 + w]);
            sum += s_red[w];
        }
        float q_inv, scale;
        Rule::fold(amax, sum, nq.sq != nullptr, nq.static_v, K, nq.eps, q_inv, scale);
        *inv = q_inv;
        if (tid == 0) *s_scale = scale;
    }
};

// The int8 / fp8 deferred RMSNorm's producer (norm_fold.py, decode up to 16 rows): an EPI 1 GEMV (o_proj,
// down_proj) writes for the norm after it (weight w [N]), per token m and 8-channel group of its output h: xg [M, N]
// = fp16(h * w), sq [M, N / 8] = sum of h^2 and mx [M, N / 8] = max |xg|. xg null: none.
struct Int8Fold {
    const __half* w;
    __half* xg;
    float* sq;
    float* mx;
};

// Token m's output h at offset o with its norm weight w: xg written, and this lane's h^2 and |xg|.
__device__ __forceinline__ void fold8_values(const Int8Fold& fold, __half h, __half w, size_t o, float& sq,
                                             float& mx) {
    const __half xg = __hmul_rn(h, w);
    fold.xg[o] = xg;
    const float f = __half2float(h);
    sq = f * f;
    mx = fabsf(__half2float(xg));
}

// ... and the 8 channels' sum and max: token m's 8 channels of group n / 8 are the lanes of equal l & 3 of the warp
// (channel n0 + l / 4 (+ 8), token from l & 3); every lane calls it.
__device__ __forceinline__ void fold8_store(const Int8Fold& fold, float sq, float mx, int l, int m, int M, int n,
                                            int N) {
#pragma unroll
    for (int d = 4; d < 32; d *= 2) {
        sq += __shfl_xor_sync(FULL_MASK, sq, d);
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, d));
    }
    if ((l >> 2) == 0 && m < M && n < N) {
        const size_t c = (size_t)m * (N / 8) + n / 8;
        fold.sq[c] = sq;
        fold.mx[c] = mx;
    }
}

// The SwiGLU epilogue's maxima: amax = |y| of this lane's (token m, channel) (0 outside), reduced over the panel's 8
// channels (the lanes of equal l & 3) into part_out [M, panels] at `panel`; with row_amax also an atomic max into
// each token's row max (float bits: non-negative floats order as unsigned ints, and a max is the same in any
// order). NaN (all 8 channels NaN) is left out, as the fmaxf reductions over part leave it out. Every lane calls it.
__device__ __forceinline__ void swiglu_amax_store(float amax, int l, int m, int M, float* part_out, unsigned panel,
                                                  unsigned panels, float* row_amax) {
    amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 4));
    amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 8));
    amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, 16));
    if ((l >> 2) == 0 && m < M) {
        part_out[(size_t)m * panels + panel] = amax;
        if (row_amax != nullptr && !isnan(amax))
            atomicMax(reinterpret_cast<unsigned*>(row_amax + m), __float_as_uint(amax));
    }
}

}  // namespace fllama
