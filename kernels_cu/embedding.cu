// Embedding lookup: out[t, :] = table[ids[t], :] for an fp16 table [V, H], 16-byte vectors.
// One block per token; an id outside [0, V) yields a row of zeros (the kernel cannot raise, and a
// device-side check keeps a bad id from reading outside the table).
// Entry points embedding_i32 / embedding_i64(out fp16 [T,H], table fp16 [V,H], ids [T], int V, int H).
// embedding_fold_i32 / _i64(out, xg fp16 [T,H], part f32 [T,H/16], table, ids, w fp16 [H], int V, int H)
// also write the first layer's deferred RMSNorm (norm_fold.cuh): xg = fp16(out * w) and the sums of out^2
// per 16 channels (H % 16 == 0), for a decode step whose RMSNorms are folded into the GEMVs.
// embedding_fold8_i32 / _i64(out, xg, part f32 [T,H/8], mx f32 [T,H/8], table, ids, w, int V, int H): the same
// for an int8 q|k|v (norm_fold.py): sums per 8 channels and mx = max |xg| per 8, as the int8 GEMVs' Int8Fold
// writes them, so layer 0's norm is a quantize_fold too (no rmsnorm_dyn: one block, ~6 us of an int8 step).
// Every entry also takes (lengths, lens) int32 [T], both null or neither: a decode step's first kernel writes
// lens = lengths + 1, the attention lengths of the step (a separate elementwise kernel, with no programmatic
// launch, would cost the step ~2 us).
#include "common.cuh"

using namespace fllama;

__device__ __forceinline__ void step_lengths(const int* __restrict__ lengths, int* __restrict__ lens) {
    if (lens != nullptr && threadIdx.x == 0) lens[blockIdx.x] = lengths[blockIdx.x] + 1;
}

template <typename Id>
__device__ __forceinline__ void embedding_row(__half* __restrict__ out, const __half* __restrict__ table,
                                              const Id* __restrict__ ids, int V, int H) {
    const size_t t = blockIdx.x;
    const long long id = (long long)ids[t];
    const bool valid = id >= 0 && id < V;
    const uint4* src = reinterpret_cast<const uint4*>(table + (valid ? id : 0) * (size_t)H);
    uint4* dst = reinterpret_cast<uint4*>(out + t * (size_t)H);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) dst[c] = valid ? src[c] : zero;
}

// Thread c of a pass holds channels [8c, 8c + 8); threads c and c ^ 1 (adjacent lanes) make one 16-channel
// sum. Every thread runs every pass so that the shuffle sees whole warps. mx non-null (int8): the thread's own
// 8-channel sum and max |xg| instead.
template <typename Id>
__device__ __forceinline__ void embedding_fold_row(__half* __restrict__ out, __half* __restrict__ xg,
                                                   float* __restrict__ part, float* __restrict__ mx,
                                                   const __half* __restrict__ table, const Id* __restrict__ ids,
                                                   const __half* __restrict__ w, int V, int H) {
    const size_t t = blockIdx.x;
    const long long id = (long long)ids[t];
    const bool valid = id >= 0 && id < V;
    const __half* src = table + (valid ? id : 0) * (size_t)H;
    for (int base = 0; base < H / 8; base += blockDim.x) {
        const int c = base + threadIdx.x;
        float sq = 0.0f;
        if (c < H / 8) {
            Half8 v = load_half8(src + 8 * c);
            if (!valid) v.h[0] = v.h[1] = v.h[2] = v.h[3] = __float2half2_rn(0.0f);
            store_half8(out + t * H + 8 * c, v);
            const Half8 wv = load_half8(w + 8 * c);
            Half8 g;
#pragma unroll
            for (int i = 0; i < 4; ++i) g.h[i] = __hmul2_rn(v.h[i], wv.h[i]);
            store_half8(xg + t * H + 8 * c, g);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float f = half8_get(v, i);
                sq = __fmaf_rn(f, f, sq);
            }
            if (mx != nullptr) {
                part[t * (H / 8) + c] = sq;
                mx[t * (H / 8) + c] = half8_absmax(g);
            }
        }
        if (mx != nullptr) continue;  // block-uniform
        sq += __shfl_xor_sync(FULL_MASK, sq, 1);
        if (c < H / 8 && (c & 1) == 0) part[t * (H / 16) + c / 2] = sq;
    }
}

// The entries for one id type: ID int32_t or int64_t, SUFFIX i32 or i64.
#define FLLAMA_EMBEDDING_ENTRIES(SUFFIX, ID)                                                                    \
    extern "C" __global__ void embedding_##SUFFIX(__half* out, const __half* table, const ID* ids, int V, int H,  \
                                                  const int* lengths, int* lens) {                              \
        pdl_enter();                                                                                            \
        step_lengths(lengths, lens);                                                                            \
        embedding_row<ID>(out, table, ids, V, H);                                                               \
    }                                                                                                           \
    extern "C" __global__ void embedding_fold_##SUFFIX(__half* out, __half* xg, float* part, const __half* table, \
                                                       const ID* ids, const __half* w, int V, int H,            \
                                                       const int* lengths, int* lens) {                         \
        pdl_enter();                                                                                            \
        step_lengths(lengths, lens);                                                                            \
        embedding_fold_row<ID>(out, xg, part, nullptr, table, ids, w, V, H);                                    \
    }                                                                                                           \
    extern "C" __global__ void embedding_fold8_##SUFFIX(__half* out, __half* xg, float* part, float* mx,         \
                                                        const __half* table, const ID* ids, const __half* w,    \
                                                        int V, int H, const int* lengths, int* lens) {          \
        pdl_enter();                                                                                            \
        step_lengths(lengths, lens);                                                                            \
        embedding_fold_row<ID>(out, xg, part, mx, table, ids, w, V, H);                                         \
    }

FLLAMA_EMBEDDING_ENTRIES(i32, int32_t)
FLLAMA_EMBEDDING_ENTRIES(i64, int64_t)
