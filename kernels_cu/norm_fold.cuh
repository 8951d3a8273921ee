// The deferred RMSNorm of decode (norm_fold.py): the norm's reduction rides on the kernels on either side of
// it, so a small-batch decode step has no RMSNorm kernel (two kernel boundaries less per layer).
//
//   producer (the GEMV that adds the residual, or the embedding lookup), besides h [M, H]:
//     xg   fp16 [M, H]      = fp16(h * w)                  w: the next RMSNorm's weight [H]
//     part fp32 [M, H / 16] = sum of h^2 over each 16 channels (a GEMV panel)
//   consumer (the GEMV that reads the norm's output): activations xg, and each token's fp32 sums scaled by
//     rstd = 1 / sqrt(sum(part) / H + eps)
//   before the fp16 rounding. Each consumer block pulls its tokens' partial sums into L1 right after the PDL
//   wait (no registers held) and each warp reduces its tokens' after its main loop, before the block's one
//   epilogue barrier. Whatever a block adds is paid once per wave of blocks, so the tail is kept to one L1 round
//   trip: normalizing the row before the first mma, or staging the sums behind more barriers, is slower, and
//   reducing inside the main loop costs registers that the AWQ variants do not have.
#pragma once
#include "common.cuh"
#include "gemm_common.cuh"

namespace fllama {

// Consumer, right after the PDL wait: the partial sums of the block's tokens into this SM's L1, warp w token
// m0 + w, lane l its line l, by one 4-byte cp.async.ca (the copy allocates the 128-byte line in L1; no
// registers are held) into the thread's own scratch word (copies into one word are unordered: racecheck).
// That covers the engine's folded buckets (rows <= WARPS, K <= 16384); other tokens and lines are read from
// L2 in the tail. (prefetch.global.L1 does not make fold_rstd's loads hit.)
template <int WARPS>
__device__ __forceinline__ void fold_prefetch(const float* part_in, int m0, int rows, int P) {
    __shared__ float scratch[WARPS * 32];  // written by the copies, never read
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp < rows && 32 * lane < P) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                         (uint32_t)__cvta_generic_to_shared(scratch + threadIdx.x)),
                     "l"(part_in + (size_t)(m0 + warp) * P + 32 * lane));
    }
    cp_async_commit();
}

// Consumer, warp w, after its main loop: rstd of its tokens m0 + w + WARPS t (t < TPW) into s_rstd (every warp
// reads it after the block's epilogue barrier). Every load of a batch is issued before the first add, so the
// tail waits for one round trip, not one per load (V x 16 bytes per lane and token: 512 sums of one token,
// 256 each of two or more; more registers here would leave the 16-token fp16 GEMV one resident block instead
// of two). A fixed summation order (lane sums, then the butterfly): every block gets the same
// bits. rsqrtf, not rmsnorm.cu's correctly rounded ops: the fold is not bitwise the unfolded path anyway.
template <int WARPS, int TPW>
__device__ __forceinline__ void fold_rstd(float* s_rstd, const float* __restrict__ part_in, int m0, int rows, int P,
                                          int K, float eps) {
    constexpr int V = TPW == 1 ? 4 : 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    cp_async_wait<0>();  // fold_prefetch's lines are in L1
    float s[TPW];
#pragma unroll
    for (int t = 0; t < TPW; ++t) s[t] = 0.0f;
    for (int c0 = 0; c0 < P; c0 += 128 * V) {
        float4 v[TPW][V];
#pragma unroll
        for (int t = 0; t < TPW; ++t) {
            const int j = warp + WARPS * t;
            const float* src = part_in + (size_t)(m0 + (j < rows ? j : 0)) * P;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const int c = c0 + 4 * lane + 128 * i;
                v[t][i] = j < rows && c < P ? __ldg(reinterpret_cast<const float4*>(src + c)) : make_float4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int t = 0; t < TPW; ++t)
#pragma unroll
            for (int i = 0; i < V; ++i) s[t] += (v[t][i].x + v[t][i].y) + (v[t][i].z + v[t][i].w);
    }
#pragma unroll
    for (int t = 0; t < TPW; ++t) {
        const int j = warp + WARPS * t;
        const float total = warp_sum(s[t]);
        if (lane == 0 && j < rows) s_rstd[j] = rsqrtf(__fdividef(total, (float)K) + eps);
    }
}

// Producer epilogue of one token m for the two channels n and n + 8 of a 16-channel panel (the mma rows g and
// g + 8) whose fp32 sums this lane holds; lanes l ^ 4, l ^ 8, l ^ 16 hold the panel's other six pairs of the
// same token (lane = 4 g + t, token from t), and all 32 lanes must call it. h = fp16(sum) + residual as the
// plain residual epilogue writes it; then xg, and the panel's sum of squares from the lane with g = 0.
// w: the norm weight of channels n, n + 8, loaded before the main loop (weights do not wait for the
// previous kernel; loaded here they cost every block a round trip to L2 in its tail).
// res: the residual of channels (n, n + 8), read by the caller (fold_store below reads it here).
__device__ __forceinline__ void fold_store_res(__half* __restrict__ y, __half* __restrict__ xg,
                                               float* __restrict__ part, __half2 res, __half2 w,
                                               float s_lo, float s_hi, int m, int M, int N, int n, int panel) {
    float sq = 0.0f;
    if (m < M) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = n + 8 * h;
            const size_t o = (size_t)m * N + c;
            const __half v = __hadd_rn(__float2half_rn(h ? s_hi : s_lo), h ? __high2half(res) : __low2half(res));
            y[o] = v;
            xg[o] = __hmul_rn(v, h ? __high2half(w) : __low2half(w));
            const float f = __half2float(v);
            sq = __fmaf_rn(f, f, sq);
        }
    }
    sq += __shfl_xor_sync(FULL_MASK, sq, 4);
    sq += __shfl_xor_sync(FULL_MASK, sq, 8);
    sq += __shfl_xor_sync(FULL_MASK, sq, 16);
    if ((threadIdx.x & 28) == 0 && m < M) part[(size_t)m * (N / 16) + panel] = sq;
}
// The residual a GEMV epilogue thread adds, read ahead (before the PDL wait) where the caller says its writer had
// completed (res_early: fp16_gemv.cu, awq_gemv.cu, int8_gemm.cu): a producer's rows r < 2 take channels (n, n + 8)
// of token m, a plain residual epilogue's row r channel n (r < 2) or n + 8. ld.cg: no line an earlier kernel left
// in this SM's L1. Zeros where the epilogue writes nothing.
__device__ __forceinline__ __half2 residual_ahead(const __half* __restrict__ residual, bool fold, int r, int m, int M,
                                                  int N, int n) {
    const int c = fold || r < 2 ? n : n + 8;
    if (r >= 4 || (fold && r >= 2) || m >= M || c >= N) return __float2half2_rn(0.0f);
    const size_t o = (size_t)m * N + c;
    return __halves2half2(__ldcg(residual + o), fold ? __ldcg(residual + o + 8) : __half());
}
__device__ __forceinline__ void fold_store(__half* __restrict__ y, __half* __restrict__ xg, float* __restrict__ part,
                                           const __half* __restrict__ residual, __half2 w,
                                           float s_lo, float s_hi, int m, int M, int N, int n, int panel) {
    const size_t o = (size_t)m * N + n;
    const __half2 res = m < M ? __halves2half2(residual[o], residual[o + 8]) : __float2half2_rn(0.0f);
    fold_store_res(y, xg, part, res, w, s_lo, s_hi, m, M, N, n, panel);
}

}  // namespace fllama
