// The sampler's reductions over a block's threads and a thread-block cluster's blocks: the argmax (greater value,
// ties to the lowest index) and the inclusive prefix sum in thread order.
#pragma once

#include "common.cuh"

namespace fllama {

// A value and its token; {-INFINITY, 0x7fffffff} is "nothing yet" (it loses to any token's value).
struct ArgMax {
    float v;
    int i;
};

// The greater value, the lower index on ties: for non-NaN values the choice is that of a total order, so any
// grouping and any order of a set of partials gives the same winner.
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Every lane of the warp gets the warp's winner (a butterfly of better()).
__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax other{__shfl_xor_sync(FULL_MASK, a.v, o), __shfl_xor_sync(FULL_MASK, a.i, o)};
        a = better(a, other);
    }
    return a;
}

// Every thread of the block calls it and gets the block's winner; sv / si: 32 floats / ints of shared memory.
__device__ ArgMax block_argmax(ArgMax a, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    a = warp_argmax(a);
    __syncthreads();
    if (lane == 0) {
        sv[warp] = a.v;
        si[warp] = a.i;
    }
    __syncthreads();
    a = lane < n_warps ? ArgMax{sv[lane], si[lane]} : ArgMax{-INFINITY, 0x7fffffff};
    return warp_argmax(a);
}

// The winner of a cluster of P blocks (sm_90), each holding its block_argmax `a`, in block 0. Blocks 1..P-1 store
// theirs into block 0's part_v / part_i (distributed shared memory, the index as float bits) and get false: they
// may exit at once. Block 0 waits for them and folds them in with better(): the same (value, index) one block over
// every slice would find. Every thread must have arrived (relaxed) at the cluster barrier before: a block's shared
// memory may be written from another only once every block has started.
__device__ bool cluster_argmax(ArgMax& a, int rank, int P, float* part_v, float* part_i) {
    cluster_wait_acquire();  // phase 1: every block of the cluster has started
    if (rank != 0) {
        if (threadIdx.x == 0) {
            st_cluster(part_v + rank, 0, a.v);
            st_cluster(part_i + rank, 0, __int_as_float(a.i));
        }
        cluster_arrive_release();  // phase 2: the partial is in block 0's shared memory
        return false;
    }
    cluster_arrive_relaxed();  // block 0 publishes nothing: no fence before its arrival
    cluster_wait_acquire();    // phase 2: every partial has landed
    for (int r = 1; r < P; ++r) a = better(a, ArgMax{part_v[r], __float_as_int(part_i[r])});
    return true;
}

// The cluster's winner in every block from each block's own (v[0], i[0] in its shared memory, written before a
// cluster barrier this thread has passed): per warp, lane r reads block r's (P <= 32). better() is a total order,
// so every block gets cluster_argmax's answer.
__device__ ArgMax cluster_argmax_all(const float* v, const int* i, int P) {
    const int lane = threadIdx.x & 31;
    const ArgMax a = lane < P ? ArgMax{*cluster_ptr(v, lane), *cluster_ptr(i, lane)} : ArgMax{-INFINITY, 0x7fffffff};
    return warp_argmax(a);
}

// Inclusive prefix sum over the block in thread order; incl[] (blockDim floats of shared memory) keeps
// every thread's inclusive value so thread t's exclusive sum is exactly incl[t - 1].
__device__ float block_inclusive_scan(float v, float* incl, float* warp_tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();
    if (lane == 31) warp_tot[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < n_warps ? warp_tot[lane] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += n;
        }
        warp_tot[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v += warp_tot[warp - 1];
    incl[threadIdx.x] = v;
    __syncthreads();
    return v;
}

}  // namespace fllama
