// The top-k / top-p candidates of sampling.cu sorted in block 0, largest key first (keys are unique: the token is
// in the low bits, so the order, and the draw, are those of any correct sort).
// A bitonic network over S = max(64, the power of two >= n) slots, the pads 0 (no candidate has key 0: NaN is never
// one), two adjacent slots a thread in registers: stride 1 inside a thread, strides 2-32 between the lanes of a warp
// (shuffles), only strides >= 64 through shared memory and barriers. At 2,048 candidates that is 15 stages of
// barriers in 66, where a network over shared memory alone pays a barrier every stage (26 us of top-p's draw, H200).
#pragma once

#include "common.cuh"

namespace fllama {

// The value slot e keeps from itself (x) and its partner e ^ stride (y) in a stage of the network that sorts runs of
// `size` slots descending where (e & size) == 0 and ascending elsewhere: the pair's lower slot takes the larger key
// in a descending run.
__device__ __forceinline__ unsigned long long bitonic_keep(unsigned long long x, unsigned long long y, int e,
                                                           int stride, int size) {
    const bool lower = (e & stride) == 0, desc = (e & size) == 0;
    return (lower == desc) == (x > y) ? x : y;
}

// Sorts cand[0, n) descending (n <= 2 * blockDim.x) and leaves slot 2t, 2t + 1 of the sorted S in thread t's *x0, *x1
// (0 past n, and in threads t >= S / 2); cand[0, S) holds them too. Every thread of the block calls it; at S = 64 warp
// 0 alone works, with no barrier. The caller synchronizes before reading cand.
__device__ void sort_candidates(unsigned long long* cand, int n, unsigned long long* x0, unsigned long long* x1) {
    int S = 64;
    while (S < n) S <<= 1;
    const int e = 2 * threadIdx.x;
    const bool holds = e < S;  // whole warps: S / 2 is a multiple of 32
    unsigned long long a = holds && e < n ? cand[e] : 0ull, b = holds && e + 1 < n ? cand[e + 1] : 0ull;
    for (int size = 2; size <= S; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride >= 64) {  // another warp's slots: through shared memory (S > 64, so every thread is here)
                __syncthreads();  // the last stage's reads are done
                if (holds) {
                    cand[e] = a;
                    cand[e + 1] = b;
                }
                __syncthreads();
                if (holds) {
                    const unsigned long long pa = cand[e ^ stride], pb = cand[(e + 1) ^ stride];
                    a = bitonic_keep(a, pa, e, stride, size);
                    b = bitonic_keep(b, pb, e + 1, stride, size);
                }
            } else if (holds && stride >= 2) {  // lane ^ (stride / 2) holds the partners, in the same registers
                const unsigned long long pa = __shfl_xor_sync(FULL_MASK, a, stride >> 1);
                const unsigned long long pb = __shfl_xor_sync(FULL_MASK, b, stride >> 1);
                a = bitonic_keep(a, pa, e, stride, size);
                b = bitonic_keep(b, pb, e + 1, stride, size);
            } else if (holds) {  // stride 1: the thread's own pair
                const unsigned long long hi = a > b ? a : b, lo = a > b ? b : a;
                const bool desc = (e & size) == 0;
                a = desc ? hi : lo;
                b = desc ? lo : hi;
            }
        }
    }
    if (S > 64) __syncthreads();  // the last shared-memory stage's reads are done
    if (holds) {
        cand[e] = a;
        cand[e + 1] = b;
    }
    *x0 = a;
    *x1 = b;
}

}  // namespace fllama
