// The fused decode attention's RoPE mode (attention_fused.cu): the query heads rotated in registers, and the new
// token's k (rotated) and v stored into the cache as rope_kv.cu stores them.
#pragma once

#include "attention_stage.cuh"

namespace fllama::fused {

// RoPE mode, issued with the query loads: the partner of each of the lane's query words (the dims D/2 away;
// for int8 caches lane t ^ 2's word, loaded again rather than shuffled; fp16 caches hold it in the lane) and
// the lane's 4 floats of the position's cos/sin row. rope_query consumes them after the stage-0 copies are
// issued, so their latency overlaps the stream (one wait, not a chain of them).
template <int D, bool KV8>
__device__ __forceinline__ void rope_query_load(uint32_t (&qp)[D / 16][2], uint4& cs4, const __half* qrow, bool qok,
                                                const float* cs_row, int lane) {
    if (KV8) {
#pragma unroll
        for (int st = 0; st < D / 16; ++st) {
            const uint2 w = ld_cached8(qrow + ((lane & 3) ^ 2) * (D / 4) + 4 * st, qok);
            qp[st][0] = w.x;
            qp[st][1] = w.y;
        }
    }
    cs4 = ld_cached(cs_row + 4 * (4 * lane < D ? lane : 0), 4 * lane < D);
}

// RoPE mode: the lane's raw query words rotated in place (rope.cuh's arithmetic); q = 0 when !rot_ok. The
// cos/sin row goes through the warp's P tile (free until the main loop) as fp16 [cos | sin of dims < D/2].
template <int D, bool KV8>
__device__ __forceinline__ void rope_query(uint32_t (&qb)[D / 16][2], const uint32_t (&qp)[D / 16][2], uint4 cs4,
                                           bool rot_ok, __half* ph, int lane) {
    constexpr int MT = D / 16;
    static_assert(D <= SLOTS * PH_STRIDE, "the cos/sin row overflows a warp's P tile");
    const int t = lane & 3;
    if (4 * lane < D) {
        const __half2 a = cos_sin_half2(make_float2(__uint_as_float(cs4.x), __uint_as_float(cs4.y)));
        const __half2 b = cos_sin_half2(make_float2(__uint_as_float(cs4.z), __uint_as_float(cs4.w)));
        *reinterpret_cast<uint2*>(ph + 4 * lane) = make_uint2(h2_bits(a), h2_bits(b));
    }
    __syncwarp();
    uint32_t r[MT][2];
#pragma unroll
    for (int st = 0; st < MT; ++st)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int dim = KV8 ? t * (D / 4) + 4 * st + 2 * j : 16 * st + 8 * j + 2 * t;
            const int i = dim & (D / 2 - 1);
            const bool low = KV8 ? t < 2 : st < MT / 2;
            const uint32_t partner = KV8 ? qp[st][j] : qb[st ^ (MT / 2)][j];
            const __half2 c = *reinterpret_cast<const __half2*>(ph + i);
            const __half2 sn = *reinterpret_cast<const __half2*>(ph + D / 2 + i);
            r[st][j] = rot_ok ? h2_bits(rotate2(bits_h2(qb[st][j]), bits_h2(partner), c, sn, low)) : 0u;
        }
#pragma unroll
    for (int st = 0; st < MT; ++st) {
        qb[st][0] = r[st][0];
        qb[st][1] = r[st][1];
    }
}

// RoPE mode: the new token's k (rotated) and v of one kv head into cache slot `slot`, as rope_kv.cu stores
// them. One warp; lane u < G = D / 16 takes k's chunk u, lane G + u v's chunk u (dims [8u, 8u + 8) and
// [D/2 + 8u, D/2 + 8u + 8)): load_new_kv issues the loads (with the query's, so that their round trip overlaps
// the stage copies), store_new_kv rotates and stores. With `stage` non-null, the same bytes also go to row
// `srow` of that shared-memory stage (issue_stage's layout), which then needs no copy of this position.
template <int D>
__device__ __forceinline__ void load_new_kv(const __half* k_src, const __half* v_src, Half8& lo, Half8& hi) {
    constexpr int G = D / 16;
    const int lane = threadIdx.x & 31, g = lane % G;
    if (lane < 2 * G) {
        const __half* src = lane >= G ? v_src : k_src;
        lo = load_half8(src + 8 * g);
        hi = load_half8(src + D / 2 + 8 * g);
    }
}
template <int D, int KV>
__device__ __forceinline__ void store_new_kv(Half8 lo, Half8 hi, const float* cs_row, void* k_cache, void* v_cache,
                                             float* k_scale, float* v_scale, size_t slot,
                                             unsigned char* stage = nullptr, int srow = 0) {
    using Gm = Geom<D, KV != KV_F16>;
    unsigned char* sk = stage;
    unsigned char* sv = stage + Gm::KV_BYTES;
    constexpr int G = D / 16;
    const int lane = threadIdx.x & 31, g = lane % G;
    const bool active = lane < 2 * G, is_v = lane >= G;
    if (active && !is_v) rotate8(lo, hi, cs_row, g, D / 2);
    if constexpr (KV == KV_F16) {
        if (active) store_head_f16(k_cache, v_cache, is_v, slot, D, D / 2, lo, hi, g);
        if (active && stage != nullptr) store_head_f16(sk, sv, is_v, srow, Gm::ROW / 2, D / 2, lo, hi, g);
    } else {
        const float m = head_absmax(lo, hi, active, G);
        if (active) store_head_q8<KV>(k_cache, v_cache, k_scale, v_scale, is_v, slot, D, D / 2, lo, hi, m, g);
        if (active && stage != nullptr) {
            float* scales = reinterpret_cast<float*>(stage + 2 * Gm::KV_BYTES);  // [k: STAGE | v: STAGE]
            store_head_q8<KV>(sk, sv, scales, scales + STAGE, is_v, srow, Gm::ROW, D / 2, lo, hi, m, g);
        }
    }
}
}  // namespace fllama::fused
