// The sampler's view of a logits row (sampling.cu): the value it ranks for each token (repetition penalty, then
// temperature), the monotone float -> uint32 key the radix select works on, and the two ways a block walks the row.
#pragma once

#include "common.cuh"

namespace fllama {

// Monotone float -> uint32 map: a > b  <=>  key(a) > key(b) (for non-NaN values).
__device__ __forceinline__ uint32_t float_key(float x) {
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Penalized logits outside (lo, hi) have values (after the temperature) outside a key range, so a select pass may
// skip their IEEE division: division by a positive temperature, rounded to nearest, is monotone. A NaN bound skips
// nothing (comparisons with NaN are false), nor does a NaN logit.
struct LogitBounds {
    float lo, hi;
};

// A logit whose value (divided by t when scaled) lies strictly beyond v toward `dir` (-INFINITY: below, INFINITY:
// above), checked with the division the row uses (a few steps of nextafterf from the product v * t); NaN (no bound)
// where v is +-inf or NaN, the temperature is odd, or the search fails.
__device__ __forceinline__ float logit_beyond(float v, float t, bool scaled, float dir) {
    const auto beyond = [&](float l) {
        const float x = scaled ? __fdiv_rn(l, t) : l;
        return dir < 0.0f ? x < v : x > v;
    };
    if ((scaled && !(t >= 1e-6f && t <= 1e6f)) || !isfinite(v)) return __int_as_float(0x7fffffff);
    float l = scaled ? __fmul_rn(v, t) : v;
    for (int i = 0; i < 4 && !beyond(l); ++i) l = nextafterf(l, dir);
    return beyond(l) ? l : __int_as_float(0x7fffffff);
}

// Bounds for keys [k_lo, k_hi] and temperature t (scaled false: no division): lo / t rounds below the range's
// least value and hi / t above its greatest.
__device__ LogitBounds logit_bounds(uint32_t k_lo, uint32_t k_hi, float t, bool scaled) {
    return {logit_beyond(key_float(k_lo), t, scaled, -INFINITY), logit_beyond(key_float(k_hi), t, scaled, INFINITY)};
}

// PEN: the row has a repetition penalty (penalty != 1). A template argument, so the rows without one, the common
// case, run walkers with no penalty code between their unrolled tokens: the sampler runs after the lm_head has
// streamed its code out of the L2, and every instruction it fetches then costs (H200, Llama-3.2-1B step at
// generate's defaults: -5 us against one instantiation that tests the penalty a token).
template <typename T, bool PEN>
struct Row {
    const T* logits;
    const uint8_t* seen;
    float penalty, inv_temp_div;  // inv_temp_div: the temperature (divided by, IEEE)
    bool scaled;

    // logit l of token v (as loaded) -> the value the sampler ranks: the penalty, then the temperature
    __device__ __forceinline__ float penalized(int v, float l) const {
        return PEN && seen[v] ? (l > 0.0f ? __fdiv_rn(l, penalty) : __fmul_rn(l, penalty)) : l;
    }
    __device__ __forceinline__ float scale(float l) const { return scaled ? __fdiv_rn(l, inv_temp_div) : l; }
    __device__ __forceinline__ float value_of(int v, float l) const { return scale(penalized(v, l)); }
    __device__ __forceinline__ float value(int v) const { return value_of(v, static_cast<float>(logits[v])); }
};

// 16-byte loads of U chunks of 8 tokens at once: a loop of one dependent 2-byte load per token would make the
// sampler a chain of L2 round trips. Two chunks: a block of a cluster walks two segments at 128k tokens, both in
// flight; four doubled every walker's unrolled code for no more loads in flight there (the 1B's sampled step 5 us
// slower on the H200, see Row), and one block of V = 32,000 walks its 4 segments in 2 rounds within 1 us of four.
template <typename T>
struct ChunkLoads {
    static constexpr int VECS = 8 * sizeof(T) / 16;  // 16-byte loads per chunk
    static constexpr int U = 2;                       // chunks in flight per thread
    uint4 raw[U][VECS];

    // chunk c (tokens 8c .. 8c+7) into slot u; the 16-byte loads need aligned rows (V % 8 == 0), else one a token
    __device__ __forceinline__ void load(const T* logits, int V, int u, int c) {
        if (V % 8 == 0) {
#pragma unroll
            for (int i = 0; i < VECS; ++i) raw[u][i] = __ldcg(reinterpret_cast<const uint4*>(logits + 8 * c) + i);
        } else {
            T* t = reinterpret_cast<T*>(raw[u]);
#pragma unroll
            for (int e = 0; e < 8; ++e) t[e] = 8 * c + e < V ? logits[8 * c + e] : T(0.0f);
        }
    }
    __device__ __forceinline__ float logit(int u, int e) const {
        return static_cast<float>(reinterpret_cast<const T*>(raw[u])[e]);
    }
};

// f(v, value) for every token v of chunks [c_lo, c_hi) of the row this thread owns, in increasing v (so "first
// seen" is "lowest index" within a thread): chunk c to thread (c - c_lo) % blockDim, U chunks' loads together.
template <typename T, bool PEN, typename F>
__device__ __forceinline__ void for_each_value(const Row<T, PEN>& row, int V, int c_lo, int c_hi, F&& f) {
    using L = ChunkLoads<T>;
    for (int c0 = c_lo + threadIdx.x; c0 < c_hi; c0 += L::U * blockDim.x) {
        L ld;
#pragma unroll
        for (int u = 0; u < L::U; ++u)
            if (c0 + u * blockDim.x < c_hi) ld.load(row.logits, V, u, c0 + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < L::U; ++u) {
            const int c = c0 + u * blockDim.x;
            if (c >= c_hi) continue;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int v = 8 * c + e;
                if (v < V) f(v, row.value_of(v, ld.logit(u, e)));
            }
        }
    }
}

template <typename T, bool PEN, typename F>
__device__ __forceinline__ void for_each_value(const Row<T, PEN>& row, int V, F&& f) {
    for_each_value(row, V, 0, (V + 7) / 8, f);
}

// Segments: SEG_CHUNKS chunks of 8 tokens, one chunk to each thread of a SEG_CHUNKS-thread block, so a segment's
// float sums have one order whichever block of a cluster walks it (and the one-block kernel walks them all).
constexpr int SEG_CHUNKS = 1024;
constexpr int SEG_TOKENS = 8 * SEG_CHUNKS;

// Segments [s_lo, s_hi): every thread calls f(v, l, ok) for the 8 tokens of its chunk s * SEG_CHUNKS + tid, l the
// logit as loaded (f takes row.value_of(v, l) where it needs the value; ok false past the row's end: l 0, seen not
// to be read) and then end(s), the same number of times in every thread (blockDim must be SEG_CHUNKS), so f and end
// may use warp collectives over the full warp.
template <typename T, bool PEN, typename F, typename E>
__device__ __forceinline__ void for_each_segment(const Row<T, PEN>& row, int V, int s_lo, int s_hi, F&& f, E&& end) {
    using L = ChunkLoads<T>;
    for (int s0 = s_lo; s0 < s_hi; s0 += L::U) {
        L ld;
#pragma unroll
        for (int u = 0; u < L::U; ++u) {
            const int c = (s0 + u) * SEG_CHUNKS + threadIdx.x;
            if (s0 + u < s_hi && 8 * c < V) ld.load(row.logits, V, u, c);
        }
#pragma unroll
        for (int u = 0; u < L::U; ++u) {
            if (s0 + u >= s_hi) break;  // uniform over the block
            const int v0 = (s0 + u) * SEG_TOKENS + 8 * threadIdx.x;
#pragma unroll
            for (int e = 0; e < 8; ++e) f(v0 + e, ld.logit(u, e), v0 + e < V);
            end(s0 + u);
        }
    }
}

}  // namespace fllama
