// The fused decode attention's combine (attention_fused.cu): a block's warps merged, a unit's blocks' partials
// merged by block 0 of its cluster (push or pull mode) or by its last block, and a row's int8 quantization.
#pragma once

#include "attention_stage.cuh"

namespace fllama::fused {

// a x + y rounded once per element, for a float or a float4 of dims
__device__ __forceinline__ float axpy(float a, float x, float y) { return __fmaf_rn(a, x, y); }
__device__ __forceinline__ float4 axpy(float a, float4 x, float4 y) {
    return make_float4(__fmaf_rn(a, x.x, y.x), __fmaf_rn(a, x.y, y.y), __fmaf_rn(a, x.z, y.z), __fmaf_rn(a, x.w, y.w));
}

// A float in block `rank`'s shared memory at the address `p` has in this block's (same kernel, same layout).
__device__ __forceinline__ float ld_cluster(const float* p, int rank) {
    const uint32_t remote = cluster_map((uint32_t)__cvta_generic_to_shared(p), rank);
    float v = 0.0f;
    FLLAMA_CLUSTER_ASM("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// The block's warps' partials of head slot h merged in warp order: m their max, l and O (at dim d: a float, or a
// float4 of dims d .. d + 3) each rescaled by 2^(m_w - m). Push and pull mode share it, so their bits agree.
template <int D, typename T>
__device__ __forceinline__ T merge_warps(const float* wo, const float* wm, const float* wl, int h, int d, float& m,
                                         float& l) {
    m = -INFINITY;
    l = 0.0f;
    T acc{};
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, wm[w * SLOTS + h]);  // finite: warp 0 had a tile
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        const float f = exp2f(wm[w * SLOTS + h] - m);
        l = __fmaf_rn(f, wl[w * SLOTS + h], l);
        acc = axpy(f, *reinterpret_cast<const T*>(wo + (w * SLOTS + h) * D + d), acc);
    }
    return acc;
}

// CL push mode: each block's partial, its warps merged per 4-dim chunk of a head (a chunk a thread), goes into block
// 0's shared memory by st.async (O as v4 into pushed [split - 1][slots][D], (m, l) as v2 into pml[split - 1][head]),
// the stores completing their bytes on block 0's mbarrier `bar`. Block 0 keeps its own in registers, waits for the
// bytes and combines every split up to CLUSTER_MAX without a branch: pml holds (-inf, 0) past the unit's blocks (weight
// 0), and their O reads the last block's (0 x finite adds nothing). Both steps add in the workspace path's order (the
// same bits): the merge over warps in warp order, l as warp_sum's butterfly adds lanes c, acc in split order.
// Returns whether the block goes on (block 0 only).
template <int D, typename Emit>
__device__ __forceinline__ bool push_combine(const float* wo, const float* wm, const float* wl, float* pushed,
                                             float2 (*pml)[SLOTS], uint32_t bar, int slots, int split, int n_act,
                                             Emit emit) {
    static_assert(CLUSTER_MAX == 16, "the butterfly below adds 16 lanes");
    for (int cq = threadIdx.x; cq < slots * D / 4; cq += THREADS) {
        const int h = 4 * cq / D, d = 4 * cq % D;
        float m, l;
        const float4 acc = merge_warps<D, float4>(wo, wm, wl, h, d, m, l);
        if (split > 0) {
            st_async_cluster4(pushed + ((split - 1) * slots + h) * D + d, 0, acc, bar);
            if (d == 0) st_async_cluster2(&pml[split - 1][h].x, 0, make_float2(m, l), bar);
            continue;
        }
        mbar_wait(bar, 0);  // every other block's partial has landed (at once after the first chunk)
        float2 ml[CLUSTER_MAX - 1];
        float M = m;
#pragma unroll
        for (int c = 1; c < CLUSTER_MAX; ++c) {
            ml[c - 1] = pml[c - 1][h];
            M = fmaxf(M, ml[c - 1].x);
        }
        float v[CLUSTER_MAX];  // lane c's w_c l_c in the workspace path's warp_sum
        const float w0 = exp2f(m - M);
        v[0] = w0 * l;
        float4 sum = axpy(w0, acc, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
#pragma unroll
        for (int c = 1; c < CLUSTER_MAX; ++c) {
            const float wc = exp2f(ml[c - 1].x - M);
            v[c] = wc * ml[c - 1].y;
            const int src = min(c, n_act - 1) - 1;
            sum = axpy(wc, *reinterpret_cast<const float4*>(pushed + (src * slots + h) * D + d), sum);
        }
        // warp_sum over lanes 0..31, 16 and up holding 0: xor 16 adds zeros, then xor 8, 4, 2, 1 pair lanes so
        float a[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) a[c] = v[c] + v[c + 8];
        const float l_sum = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        emit(h, d, __float2half_rn(sum.x / l_sum));
        emit(h, d + 1, __float2half_rn(sum.y / l_sum));
        emit(h, d + 2, __float2half_rn(sum.z / l_sum));
        emit(h, d + 3, __float2half_rn(sum.w / l_sum));
    }
    return split == 0;
}

// The row's last unit: per-token dynamic quantization of its n fp16 outputs (quantize.cu's rule), read back from
// L2 (every unit's block wrote its heads before the row's counter), into q_row and *a_scale.
__device__ __forceinline__ void quantize_row(const __half* out_row, int8_t* q_row, float* a_scale, int n,
                                             float* s_red) {
    const int tid = threadIdx.x;
    const uint4* row = reinterpret_cast<const uint4*>(out_row);
    const int nvec = n / 8;
    float amax = 0.0f;
    for (int c = tid; c < nvec; c += THREADS) {
        const uint4 v = __ldcg(row + c);
        amax = fmaxf(amax, half8_absmax(*reinterpret_cast<const Half8*>(&v)));
    }
    float inv, scale;
    amax_scales(block_max(amax, s_red), inv, scale);
    for (int c = tid; c < nvec; c += THREADS) {
        const uint4 v = __ldcg(row + c);
        quantize_store8(q_row + 8 * c, *reinterpret_cast<const Half8*>(&v), inv);
    }
    if (tid == 0) *a_scale = scale;
}

// A block's place in its unit (row b's query-head slots from head0, of H heads): split `split` of the S a row
// may have, n_act of them active; u indexes the unit's counter.
struct UnitSplit {
    int b, H, head0, S, split, n_act, slots, u;
};

// Pull mode (no push): the block's warps merged per (head slot, dim). A unit of one block writes its output; else
// each block leaves its partial (O, m, l) in its shared memory (CL) or the workspace, and block 0 of the cluster
// (after the cluster barrier), or the unit's last block to arrive (after its fence and counter), combines them in
// split order. Returns whether the block goes on (the one that combined, or a unit of one block).
template <int D, bool KV8, bool CL, typename Emit>
__device__ __forceinline__ bool pull_combine(unsigned char* smem, const float* wo, const float* wm, const float* wl,
                                             float* part_o, float* part_ml, int* counters, int& s_last, float* s_l,
                                             UnitSplit us, int len, Emit emit) {
    using G = Geom<D, KV8>;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = us.b, H = us.H, head0 = us.head0, S = us.S, split = us.split, n_act = us.n_act, slots = us.slots;
    const int u = us.u;
    for (int e = tid; e < slots * D; e += THREADS) {
        const int h = e / D, d = e % D;
        float acc = 0.0f, l = 0.0f, m = -INFINITY;
        if (len > 0) acc = merge_warps<D, float>(wo, wm, wl, h, d, m, l);
        if (n_act == 1) {
            emit(h, d, __float2half_rn(len > 0 ? acc / l : 0.0f));  // an empty row attends to nothing
        } else if (CL) {
            float* cl_o = reinterpret_cast<float*>(smem) + G::CL_O;
            float* cl_ml = reinterpret_cast<float*>(smem) + G::CL_ML;
            cl_o[h * D + d] = acc;
            if (d == 0) {
                cl_ml[2 * h] = m;
                cl_ml[2 * h + 1] = l;
            }
        } else {
            const size_t ph_idx = ((size_t)b * H + head0 + h) * S + split;
            part_o[ph_idx * D + d] = acc;
            if (d == 0) {
                part_ml[2 * ph_idx] = m;
                part_ml[2 * ph_idx + 1] = l;
            }
        }
    }

    // the unit's combine: partial c's (m, l) of head slot h and its O at dim d, from the workspace (after the
    // last block's fence and counter) or, CL, from block c's shared memory (after the cluster barrier)
    const float* cl_o = reinterpret_cast<const float*>(smem) + G::CL_O;
    const float* cl_ml = reinterpret_cast<const float*>(smem) + G::CL_ML;
    auto part_m = [&](int h, int c) {
        return CL ? ld_cluster(cl_ml + 2 * h, c) : __ldcg(part_ml + (((size_t)b * H + head0 + h) * S + c) * 2);
    };
    auto part_l = [&](int h, int c) {
        return CL ? ld_cluster(cl_ml + 2 * h + 1, c)
                  : __ldcg(part_ml + (((size_t)b * H + head0 + h) * S + c) * 2 + 1);
    };
    auto part_od = [&](int h, int d, int c) {
        return CL ? ld_cluster(cl_o + h * D + d, c)
                  : __ldcg(part_o + (((size_t)b * H + head0 + h) * S + c) * D + d);
    };
    attn_stamp(5);
    if (CL && n_act > 1) cluster_sync();  // every block's partial is in its shared memory
    attn_stamp(6);
    if (CL && n_act > 1 && split == 0) {
        // Block 0 of the cluster. Each thread issues every remote load it needs at once (lane c's (m_c, l_c),
        // its dim's n_act partials): one DSMEM round trip, no barrier. Then the workspace path's arithmetic
        // in its order (the same bits): M and l by the same butterflies, acc summed in split order with
        // lane c's weight exp2(m_c - M) broadcast by a shuffle. h is warp-uniform (D % 32 == 0).
        for (int e = tid; e < slots * D; e += THREADS) {
            const int h = e / D, d = e % D;
            const float mc = lane < n_act ? part_m(h, lane) : -INFINITY;
            const float lc = lane < n_act ? part_l(h, lane) : 0.0f;
            float pv[CLUSTER_MAX];
#pragma unroll
            for (int c = 0; c < CLUSTER_MAX; ++c) pv[c] = c < n_act ? part_od(h, d, c) : 0.0f;
            const float m = warp_max(mc);
            const float w = lane < n_act ? exp2f(mc - m) : 0.0f;
            const float l = warp_sum(w * lc);
            float acc = 0.0f;
#pragma unroll
            for (int c = 0; c < CLUSTER_MAX; ++c) {
                const float wc = __shfl_sync(FULL_MASK, w, c);
                if (c < n_act) acc += wc * pv[c];
            }
            emit(h, d, __float2half_rn(acc / l));
        }
    } else if (!CL && n_act > 1 && last_block_arrives(&counters[u], n_act, s_last)) {
        // The unit's last block: each head's weights once, then plain sums (the pass above recomputes them for
        // every element through two butterflies). The merge area is free: every thread of the block passed it
        // before the counter.
        float* wts = reinterpret_cast<float*>(smem);  // [SLOTS][S] weights 2^(m_c - M) (over the merge area)
        for (int h = warp; h < slots; h += WARPS) {
            float m = -INFINITY;
            for (int c = lane; c < n_act; c += 32) m = fmaxf(m, part_m(h, c));
            m = warp_max(m);
            float l = 0.0f;
            for (int c = lane; c < n_act; c += 32) {
                const float w = exp2f(part_m(h, c) - m);
                wts[h * S + c] = w;
                l += w * part_l(h, c);
            }
            l = warp_sum(l);
            if (lane == 0) s_l[h] = l;
        }
        __syncthreads();
        attn_stamp(8);
        for (int e = tid; e < slots * D; e += THREADS) {
            const int h = e / D, d = e % D;
            float acc = 0.0f;
#pragma unroll 4
            for (int c = 0; c < n_act; ++c) acc += wts[h * S + c] * part_od(h, d, c);
            emit(h, d, __float2half_rn(acc / s_l[h]));
        }
        attn_stamp(11);
    } else if (n_act > 1 && !CL) {
        return false;  // not the unit's last block
    }
    if (CL && n_act > 1) {
        if (split == 0) attn_stamp(7);
        cluster_sync();  // block 0 has read every partial: the others may exit
        if (split != 0) {
            attn_stamp(7);
            return false;
        }
    }
    return true;
}

}  // namespace fllama::fused
