// The fused decode attention's stages (attention_fused.cu): its geometry, the cp.async copies of a stage's K / V
// rows into shared memory, a warp's step over one tile of a stage, and the timing probe.
#pragma once

#include "attention_common.cuh"

// Timing probe (-DFLLAMA_ATTN_PROBE, never in the engine's build): thread 0 of each fused block stamps
// %globaltimer at its phases into fllama_attn_probe[block][phase] (slot 15: the SM), read back by
// kernels_cu.lab.attention_probe. Phases: 0 entry, 1 split known, 2 stage copies issued, 3 first stage landed,
// 4 main loop done, 5 partial written, 6 first cluster barrier passed, 7 exit; 8: the two-pass combine's weights
// ready (its first pass); 9 the warps' partials stored for the merge, 10 the push's cluster wait passed, 11 block 0's
// combine done (push, two-pass), 12 the PDL wait passed (RoPE mode), 13 the query rotated (before the new k / v store).
#ifdef FLLAMA_ATTN_PROBE
__device__ unsigned long long fllama_attn_probe[8192][16];
__device__ __forceinline__ void attn_stamp(int phase) {
    if (threadIdx.x != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const unsigned blk = blockIdx.y * gridDim.x + blockIdx.x;
    if (blk < 8192) {
        fllama_attn_probe[blk][phase] = t;
        if (phase == 0) {
            unsigned sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            fllama_attn_probe[blk][15] = sm;
        }
    }
}
#else
__device__ __forceinline__ void attn_stamp(int) {}
#endif

namespace fllama::fused {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int STAGE = WARPS * 16;  // positions per pipeline stage: one 16-position tile per warp
constexpr int NBUF = 2;            // stages resident in shared memory
constexpr int PH_STRIDE = 24;      // halves per head row of a warp's P tile: conflict-free reads and writes
constexpr int MAX_SPLITS = 512;
constexpr int CLUSTER_MAX = 16;  // blocks per cluster (non-portable above 8; H100 / H200 allow 16)

// Shared-memory layout, mirrored by attention_decode.fused_smem_bytes: NBUF x [K | V | k scales | v
// scales], then the warps' P tiles. Rows are padded by 16 bytes so the 8 rows one ldmatrix phase reads
// start in 8 different bank groups.
template <int D, bool KV8>
struct Geom {
    static constexpr int RB = KV8 ? D : 2 * D;  // cache bytes per position
    static constexpr int ROW = RB + 16;
    static constexpr int CHUNKS = RB / 16;      // 16-byte copies per position
    static constexpr int KV_BYTES = STAGE * ROW;
    static constexpr int BUF_BYTES = 2 * KV_BYTES + (KV8 ? 2 * STAGE * 4 : 0);
    static constexpr int PH_BYTES = WARPS * SLOTS * PH_STRIDE * 2;
    static constexpr int SMEM = NBUF * BUF_BYTES + PH_BYTES;
    static constexpr int PER_THREAD = STAGE * CHUNKS / THREADS;
    static_assert(STAGE * CHUNKS % THREADS == 0, "a stage's copies must split evenly over the threads");
    static_assert(THREADS == 2 * STAGE, "one thread per int8 scale of a stage");
    // the warps' merge area and the combine's weights reuse the stage buffers
    static_assert(WARPS * SLOTS * (D + 2) * 4 <= NBUF * BUF_BYTES, "merge area overflows the stage buffers");
    static_assert(SLOTS * MAX_SPLITS * 4 <= NBUF * BUF_BYTES, "combine weights overflow the stage buffers");
    // CL pull mode: the block's partial O [SLOTS][D] and (m, l) [SLOTS][2] in floats, after the merge area (block
    // 0's one-pass combine keeps its weights in registers, so nothing else is written there until the second barrier)
    static constexpr int CL_O = WARPS * SLOTS * (D + 2), CL_ML = CL_O + SLOTS * D;
    static_assert((CL_ML + 2 * SLOTS) * 4 <= NBUF * BUF_BYTES, "cluster partials overflow the stage buffers");
    // CL push mode: the other blocks' O partials in block 0's shared memory, past everything block 0 writes there when
    // its range is one stage (stage buffer 0 and the merge area; its own partial stays in registers). PUSH_OFF is
    // also past the pull layout's CL_END, which push mode does not write: the capacity the push / pull choice was
    // measured and tested with (a larger one would push some int8-cache d128 lengths that pull now).
    static constexpr int CL_END = (CL_ML + 2 * SLOTS) * 4;
    static constexpr int PUSH_OFF = ((CL_END > BUF_BYTES ? CL_END : BUF_BYTES) + 15) / 16 * 16;
    static constexpr int PUSH_BYTES = NBUF * BUF_BYTES - PUSH_OFF;
    static_assert(PUSH_BYTES >= 2 * (D + 2) * 4, "no room for pushed partials");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(ok ? 4 : 0));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                              uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// Copies of stage positions [p0, p0 + STAGE) of one (row, kv head) into buf; zero past `hi`. Position
// `skip` (-1: none) gets no copy at all: the block writes that row itself (RoPE mode's new token).
template <int D, bool KV8>
__device__ __forceinline__ void issue_stage(unsigned char* buf, const void* k_cache, const void* v_cache,
                                            const float* k_scale, const float* v_scale, size_t row0, int p0,
                                            int hi, int skip = -1) {
    using G = Geom<D, KV8>;
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < G::PER_THREAD; ++i) {
        const int idx = tid + i * THREADS, p = idx / G::CHUNKS, c = idx % G::CHUNKS;
        const bool ok = p0 + p < hi;
        if (p0 + p == skip) continue;
        const size_t off = (row0 + (ok ? p0 + p : 0)) * G::RB + 16 * c;  // a valid address even when !ok
        cp_async16(buf + p * G::ROW + 16 * c, static_cast<const char*>(k_cache) + off, ok);
        cp_async16(buf + G::KV_BYTES + p * G::ROW + 16 * c, static_cast<const char*>(v_cache) + off, ok);
    }
    if (KV8) {
        float* scales = reinterpret_cast<float*>(buf + 2 * G::KV_BYTES);  // [k: STAGE | v: STAGE]
        const int p = tid % STAGE;
        const bool ok = p0 + p < hi;
        const float* src = (tid < STAGE ? k_scale : v_scale) + row0 + (ok ? p0 + p : 0);
        if (p0 + p != skip) cp_async4(scales + tid, src, ok);
    }
}

// P slot of tile position p in a warp's transpose buffer: the order in which the PV mma's B operand
// wants them (lane t reads slots 4t .. 4t + 3 with one 8-byte load). fp16 V comes through ldmatrix.trans
// in natural position order (B = positions 2t, 2t + 1, 2t + 8, 2t + 9); int8 V through the prmt
// transpose of positions 4t .. 4t + 3.
template <bool KV8>
__device__ __forceinline__ int p_slot(int p) {
    if (KV8) return p;
    return 4 * ((p & 7) >> 1) + 2 * (p >> 3) + (p & 1);
}

// Dimension of accumulator o[mt][r] for lane group g.
template <int D, bool KV8>
__device__ __forceinline__ int acc_dim(int mt, int r, int g) {
    if (KV8) return 8 * (g + 8 * (mt >> 2)) + 2 * (mt & 3) + (r >> 1);  // mt = 4i + jp, as attn_decode
    return 16 * mt + g + 8 * (r >> 1);
}

// One warp's tile of 16 positions from t0 (< hi) of a stage in shared memory (its K rows at kt, V rows
// G::KV_BYTES on, 8-bit scales at ksc): S = K Q^T, the online softmax's update of the heads' running (m, l) and
// accumulators o, and O^T += V^T P^T with P rounded to fp16 through the warp's transpose buffer ph.
template <int D, int KV>
__device__ __forceinline__ void tile_step(const unsigned char* kt, const float* ksc, const uint32_t (&qb)[D / 16][2],
                                          int t0, int hi, float scale_log2, __half* ph, float (&o)[D / 16][4],
                                          float& m0, float& m1, float& l0, float& l1) {
    constexpr bool KV8 = KV != KV_F16;
    using G = Geom<D, KV8>;
    constexpr int MT = D / 16;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned char* vt = kt + G::KV_BYTES;

    // scores: rows g, g + 8 = positions, columns 2t, 2t + 1 = head slots
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (KV8) {
        uint32_t kl[D / 8], kh[D / 8];
#pragma unroll
        for (int j = 0; j < D / 64; ++j) {
            const uint4 rl = *reinterpret_cast<const uint4*>(kt + g * G::ROW + t * (D / 4) + 16 * j);
            const uint4 rh = *reinterpret_cast<const uint4*>(kt + (g + 8) * G::ROW + t * (D / 4) + 16 * j);
            kv_codes4_to_h2x2<KV>(rl.x, kl[8 * j + 0], kl[8 * j + 1]);
            kv_codes4_to_h2x2<KV>(rl.y, kl[8 * j + 2], kl[8 * j + 3]);
            kv_codes4_to_h2x2<KV>(rl.z, kl[8 * j + 4], kl[8 * j + 5]);
            kv_codes4_to_h2x2<KV>(rl.w, kl[8 * j + 6], kl[8 * j + 7]);
            kv_codes4_to_h2x2<KV>(rh.x, kh[8 * j + 0], kh[8 * j + 1]);
            kv_codes4_to_h2x2<KV>(rh.y, kh[8 * j + 2], kh[8 * j + 3]);
            kv_codes4_to_h2x2<KV>(rh.z, kh[8 * j + 4], kh[8 * j + 5]);
            kv_codes4_to_h2x2<KV>(rh.w, kh[8 * j + 6], kh[8 * j + 7]);
        }
#pragma unroll
        for (int st = 0; st < MT; ++st)
            mma_f16_16816(sc, kl[2 * st], kh[2 * st], kl[2 * st + 1], kh[2 * st + 1], qb[st][0], qb[st][1]);
    } else {
        const uint32_t ka = smem_addr(kt + ((lane & 7) + 8 * ((lane >> 3) & 1)) * G::ROW + 16 * (lane >> 4));
#pragma unroll
        for (int st = 0; st < MT; ++st) {
            uint32_t a0, a1, a2, a3;
            ldsm_x4(ka + 32 * st, a0, a1, a2, a3);
            mma_f16_16816(sc, a0, a1, a2, a3, qb[st][0], qb[st][1]);
        }
    }
    const bool okl = t0 + g < hi, okh = t0 + g + 8 < hi;
    float fl = scale_log2, fh = scale_log2;
    if (KV8) {
        fl *= ksc[g];
        fh *= ksc[g + 8];
    }
    const float x0 = okl ? sc[0] * fl : -INFINITY, x1 = okl ? sc[1] * fl : -INFINITY;
    const float x2 = okh ? sc[2] * fh : -INFINITY, x3 = okh ? sc[3] * fh : -INFINITY;

    // online softmax: the tile's max over its 16 positions (lanes of equal t), finite since
    // position t0 is valid
    float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, off));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);  // 0 on the warp's first tile
    m0 = mn0;
    m1 = mn1;
    const __half p0 = __float2half_rn(exp2f(x0 - mn0)), p1 = __float2half_rn(exp2f(x1 - mn1));
    const __half p2 = __float2half_rn(exp2f(x2 - mn0)), p3 = __float2half_rn(exp2f(x3 - mn1));
    l0 = l0 * al0 + (__half2float(p0) + __half2float(p2));
    l1 = l1 * al1 + (__half2float(p1) + __half2float(p3));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        o[mt][0] *= al0;
        o[mt][1] *= al1;
        o[mt][2] *= al0;
        o[mt][3] *= al1;
    }
    __syncwarp();  // the previous tile's P reads are done
    ph[2 * t * PH_STRIDE + p_slot<KV8>(g)] = p0;
    ph[(2 * t + 1) * PH_STRIDE + p_slot<KV8>(g)] = p1;
    ph[2 * t * PH_STRIDE + p_slot<KV8>(g + 8)] = p2;
    ph[(2 * t + 1) * PH_STRIDE + p_slot<KV8>(g + 8)] = p3;
    __syncwarp();
    const uint2 pp = *reinterpret_cast<const uint2*>(ph + g * PH_STRIDE + 4 * t);  // head g

    // O^T += V^T P^T: rows = dims, columns = head slots
    if constexpr (KV == KV_F8) {
        // e4m3: two codes a conversion (cvt takes 16 bits), so each mma's A words are made from the raw
        // bytes just before it: 8 registers of codes live instead of 16 of fp16 values
        const float* vsc = ksc + STAGE;
#pragma unroll
        for (int i = 0; i < D / 64; ++i) {
            uint2 raw[4];
            float s[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                raw[r] = *reinterpret_cast<const uint2*>(vt + (4 * t + r) * G::ROW + 8 * (g + 8 * i));
                s[r] = vsc[4 * t + r];
            }
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
                uint32_t w[4];  // dims 8(g + 8i) + 2jp, +1 of positions 4t + r, as scale8 makes them
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    w[r] = scale2(kv_e4m3x2_to_h2((jp < 2 ? raw[r].x : raw[r].y) >> (16 * (jp & 1))), s[r]);
                mma_f16_16816(o[4 * i + jp], pair_lo(w[0], w[1]), pair_hi(w[0], w[1]), pair_lo(w[2], w[3]),
                              pair_hi(w[2], w[3]), pp.x, pp.y);
            }
        }
    } else if (KV8) {
        const float* vsc = ksc + STAGE;
#pragma unroll
        for (int i = 0; i < D / 64; ++i) {
            uint4 v[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const uint2 raw = *reinterpret_cast<const uint2*>(vt + (4 * t + r) * G::ROW + 8 * (g + 8 * i));
                kv_codes4_to_h2x2<KV>(raw.x, v[r].x, v[r].y);
                kv_codes4_to_h2x2<KV>(raw.y, v[r].z, v[r].w);
                v[r] = scale8(v[r], vsc[4 * t + r]);
            }
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
                const uint32_t a0 = pair_lo(word(v[0], jp), word(v[1], jp));
                const uint32_t a1 = pair_hi(word(v[0], jp), word(v[1], jp));
                const uint32_t a2 = pair_lo(word(v[2], jp), word(v[3], jp));
                const uint32_t a3 = pair_hi(word(v[2], jp), word(v[3], jp));
                mma_f16_16816(o[4 * i + jp], a0, a1, a2, a3, pp.x, pp.y);
            }
        }
    } else {
        const uint32_t va = smem_addr(vt + ((lane & 7) + 8 * (lane >> 4)) * G::ROW + 16 * ((lane >> 3) & 1));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            uint32_t a0, a1, a2, a3;
            ldsm_x4_trans(va + 32 * mt, a0, a1, a2, a3);
            mma_f16_16816(o[mt], a0, a1, a2, a3, pp.x, pp.y);
        }
    }
}

}  // namespace fllama::fused
