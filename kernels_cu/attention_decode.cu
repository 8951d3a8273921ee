// Decode attention, flash-decoding style: one new query token per row against the KV cache.
//   q [B, H, D] fp16 (rotated), k/v cache [B, Hkv, L, D] fp16, or int8 / e4m3 codes (+ fp32 scales
//   [B, Hkv, L], value = code * scale; kv_codes.cuh), lengths int32 [B] on the device (valid positions incl.
//   the new token).
//   out[b, h] = softmax(q . K^T / sqrt(D)) V over positions [0, lengths[b]), fp32 softmax.
//
// attn_decode_d{64,128}[_kv8|_kvf8]: block (chunk, row b, kv head, group of up to 8 query heads of that kv
//   head), 4 warps; the chunk is CS positions (<= 512, multiple of 16). K and V are read once for all
//   the query heads that share them, and both products run on tensor cores with the query heads as the
//   mma's 8-wide N dimension:
//   1. scores S[pos, head] = K Q^T: A = 16 positions x 16 dims of K (lane (g, t) loads rows g and g + 8,
//      dims [t D/4, (t+1) D/4) in 16-byte pieces), B = the same dims of head g's query. Stored x log2(e)
//      / sqrt(D) (x k_scale[pos] for 8-bit codes: the per-position scale factors out of the dot product).
//      Positions past the row's length get -inf.
//   2. per head: m = max, P = exp2(S - m) rounded to fp16 (the mma operand), l = sum of those P.
//   3. O^T[dim, head] = V^T P^T: A = V^T, built from lane (g, t)'s 16-byte loads of positions 4t..4t+3
//      at dims 8(g + 8i).. with a prmt 2x2 transpose per dim pair (the same trick as awq_gemm.cu), B = P.
//   4. the 4 warps' partial O meet in shared memory; (O, m, l) go to fp32 workspaces per chunk.
//   grid (C = ceil(L / CS), B * Hkv * ceil(R / 8)), block 128. Chunks at or past a row's length exit at
//   once, so one launch shape (hence one CUDA graph) serves every step.
// attn_decode_combine: out = sum_c 2^(m_c - M) O_c / sum_c 2^(m_c - M) l_c over the row's chunks.
//   grid B * H, block 128 (thread = dim).
#include "common.cuh"
#include "gemm_common.cuh"
#include "rope.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 4;
constexpr int SLOTS = 8;  // query heads per block: the mma N dimension
constexpr int NOT_EARLY = 1 << 30;  // the two-kernel path's rows for pdl_enter_attention: it keeps trigger 3's points
constexpr int CS_MAX = 512;
constexpr int SC_STRIDE = CS_MAX + 4;  // floats; +4 spreads the 8 heads a warp writes over all banks
constexpr int P_STRIDE = CS_MAX + 8;   // halves; rows stay 16-byte aligned

// Eight consecutive cache values as four fp16 pairs (8-bit codes as their exact values), zero when !ok
// (positions past the length may hold anything, NaN included, and the P = 0 that meets them must not become NaN).
template <int KV>
__device__ __forceinline__ uint4 load8(const void* cache, size_t elem, bool ok) {
    if constexpr (KV != KV_F16) {
        const uint2 raw = ld_stream8(static_cast<const int8_t*>(cache) + elem, ok);
        uint4 v;
        kv_codes4_to_h2x2<KV>(raw.x, v.x, v.y);
        kv_codes4_to_h2x2<KV>(raw.y, v.z, v.w);
        return v;
    }
    return ld_stream(static_cast<const __half*>(cache) + elem, ok);
}

// 8-bit V: dequantize to fp16 once per element (value = code * scale, fp32 product, one rounding).
__device__ __forceinline__ uint32_t scale2(uint32_t h2, float s) {
    const float2 f = __half22float2(bits_h2(h2));
    return h2_bits(__floats2half2_rn(f.x * s, f.y * s));
}
// a x + y rounded once per element, for a float or a float4 of dims
__device__ __forceinline__ float axpy(float a, float x, float y) { return __fmaf_rn(a, x, y); }
__device__ __forceinline__ float4 axpy(float a, float4 x, float4 y) {
    return make_float4(__fmaf_rn(a, x.x, y.x), __fmaf_rn(a, x.y, y.y), __fmaf_rn(a, x.z, y.z), __fmaf_rn(a, x.w, y.w));
}
__device__ __forceinline__ uint4 scale8(uint4 v, float s) {
    return make_uint4(scale2(v.x, s), scale2(v.y, s), scale2(v.z, s), scale2(v.w, s));
}

template <int D, int KV>
__device__ __forceinline__ void attn_decode(float* __restrict__ part_o, float* __restrict__ part_ml,
                                            const __half* __restrict__ q, const void* __restrict__ k_cache,
                                            const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                            const float* __restrict__ v_scale, const int* __restrict__ lengths,
                                            int H, int Hkv, int L, int CS, int C, float scale_log2) {
    constexpr int QV = D / 32;  // 16-byte query / key pieces per lane (dims [t D/4, (t+1) D/4))
    constexpr int VC = D / 64;  // 8-dim V chunks per lane (dims 8(g + 8i) ..)
    constexpr bool KV8 = KV != KV_F16;  // 8-bit codes with scales
    __shared__ float sc[SLOTS][SC_STRIDE];
    __shared__ __align__(16) __half ph[SLOTS][P_STRIDE];
    __shared__ float ml[SLOTS][2];

    const int R = H / Hkv, HG = (R + SLOTS - 1) / SLOTS;
    const int chunk = blockIdx.x;
    const int hg = blockIdx.y % HG, kvh = (blockIdx.y / HG) % Hkv, b = blockIdx.y / (HG * Hkv);
    const int len = min(lengths[b], L);
    const int p0 = chunk * CS;
    if (p0 >= len) return;  // whole block: before any barrier
    const int cnt = min(CS, len - p0), ntiles = (cnt + 15) / 16;
    const int slots = min(SLOTS, R - hg * SLOTS);
    const int head0 = kvh * R + hg * SLOTS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const size_t row0 = ((size_t)b * Hkv + kvh) * L;  // cache row of position 0

    uint4 qf[QV];
    const __half* q_row = q + ((size_t)b * H + head0 + (g < slots ? g : 0)) * D + t * (D / 4);
#pragma unroll
    for (int i = 0; i < QV; ++i) qf[i] = ld_cached(q_row + 8 * i, g < slots);

    // 1. scores
    for (int j = warp; j < ntiles; j += WARPS) {
        const int il = j * 16 + g, ih = il + 8;
        const bool okl = p0 + il < len, okh = p0 + ih < len;
        uint4 kl[QV], kh[QV];
#pragma unroll
        for (int i = 0; i < QV; ++i) {
            kl[i] = load8<KV>(k_cache, (row0 + p0 + il) * D + t * (D / 4) + 8 * i, okl);
            kh[i] = load8<KV>(k_cache, (row0 + p0 + ih) * D + t * (D / 4) + 8 * i, okh);
        }
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int st = 0; st < D / 16; ++st) {
            const int i = st / 2, w = 2 * (st % 2);
            mma_f16_16816(s, word(kl[i], w), word(kh[i], w), word(kl[i], w + 1), word(kh[i], w + 1),
                          word(qf[i], w), word(qf[i], w + 1));
        }
        float fl = scale_log2, fh = scale_log2;
        if (KV8) {
            fl *= okl ? k_scale[row0 + p0 + il] : 0.0f;
            fh *= okh ? k_scale[row0 + p0 + ih] : 0.0f;
        }
        sc[2 * t][il] = okl ? s[0] * fl : -INFINITY;
        sc[2 * t + 1][il] = okl ? s[1] * fl : -INFINITY;
        sc[2 * t][ih] = okh ? s[2] * fh : -INFINITY;
        sc[2 * t + 1][ih] = okh ? s[3] * fh : -INFINITY;
    }
    __syncthreads();

    // 2. softmax statistics; warp w owns heads 2w and 2w + 1. Unused head slots (R < 8) get P = 0 without
    // the exp work: they only feed output columns that are never written.
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const int h = 2 * warp + hi;
        if (h >= slots) {  // warp-uniform
            for (int i = lane; i < ntiles * 16; i += 32) ph[h][i] = __float2half_rn(0.0f);
            continue;
        }
        float m = -INFINITY;
        for (int i = lane; i < cnt; i += 32) m = fmaxf(m, sc[h][i]);
        m = warp_max(m);  // finite: cnt >= 1 and every score below cnt is finite
        float l = 0.0f;
        for (int i = lane; i < ntiles * 16; i += 32) {
            const __half e = __float2half_rn(i < cnt ? exp2f(sc[h][i] - m) : 0.0f);
            ph[h][i] = e;
            l += __half2float(e);
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[h][0] = m;
            ml[h][1] = l;
        }
    }
    __syncthreads();

    // 3. O^T = V^T P^T
    float o[VC][4][4];
#pragma unroll
    for (int i = 0; i < VC; ++i)
#pragma unroll
        for (int jp = 0; jp < 4; ++jp)
#pragma unroll
            for (int r = 0; r < 4; ++r) o[i][jp][r] = 0.0f;
    for (int j = warp; j < ntiles; j += WARPS) {
        const int pb = j * 16 + 4 * t;  // the lane's positions pb .. pb + 3 (chunk-local)
        uint4 v[4][VC];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const bool ok = p0 + pb + r < len;
#pragma unroll
            for (int i = 0; i < VC; ++i) v[r][i] = load8<KV>(v_cache, (row0 + p0 + pb + r) * D + 8 * (g + 8 * i), ok);
            if (KV8) {
                const float s = ok ? v_scale[row0 + p0 + pb + r] : 0.0f;
#pragma unroll
                for (int i = 0; i < VC; ++i) v[r][i] = scale8(v[r][i], s);
            }
        }
        const uint2 pp = *reinterpret_cast<const uint2*>(&ph[g][pb]);  // P of head g at pb .. pb + 3
#pragma unroll
        for (int i = 0; i < VC; ++i)
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
                const uint32_t a0 = pair_lo(word(v[0][i], jp), word(v[1][i], jp));
                const uint32_t a1 = pair_hi(word(v[0][i], jp), word(v[1][i], jp));
                const uint32_t a2 = pair_lo(word(v[2][i], jp), word(v[3][i], jp));
                const uint32_t a3 = pair_hi(word(v[2][i], jp), word(v[3][i], jp));
                mma_f16_16816(o[i][jp], a0, a1, a2, a3, pp.x, pp.y);
            }
    }

    // 4. sum the warps' partials (scores are dead since the last barrier: reuse their memory)
    float* red = &sc[0][0];  // [WARPS][VC * 16][32]
    constexpr int PER_WARP = VC * 16 * 32;
    static_assert(WARPS * PER_WARP <= SLOTS * SC_STRIDE, "reduction buffer overflows the score buffer");
#pragma unroll
    for (int i = 0; i < VC; ++i)
#pragma unroll
        for (int jp = 0; jp < 4; ++jp)
#pragma unroll
            for (int r = 0; r < 4; ++r) red[warp * PER_WARP + ((i * 4 + jp) * 4 + r) * 32 + lane] = o[i][jp][r];
    __syncthreads();
    for (int e = threadIdx.x; e < PER_WARP; e += WARPS * 32) {
        const float s = ((red[e] + red[PER_WARP + e]) + red[2 * PER_WARP + e]) + red[3 * PER_WARP + e];
        const int ln = e & 31, idx = e >> 5;
        const int r = idx & 3, jp = (idx >> 2) & 3, i = idx >> 4;
        const int d = 8 * ((ln >> 2) + 8 * i) + 2 * jp + (r >> 1);
        const int slot = 2 * (ln & 3) + (r & 1);
        if (slot < slots) part_o[(((size_t)b * H + head0 + slot) * C + chunk) * D + d] = s;
    }
    if (threadIdx.x < slots) {
        float* dst = part_ml + (((size_t)b * H + head0 + threadIdx.x) * C + chunk) * 2;
        dst[0] = ml[threadIdx.x][0];
        dst[1] = ml[threadIdx.x][1];
    }
}

}  // namespace

// (part_o f32 [B,H,C,D], part_ml f32 [B,H,C,2], q fp16 [B,H,D], k_cache, v_cache [B,Hkv,L,D] fp16 / int8 / e4m3,
//  k_scale, v_scale f32 [B,Hkv,L] or null, lengths i32 [B], int H, int Hkv, int L, int CS, int C,
//  float scale_log2 = log2(e) / sqrt(D))
#define FLLAMA_ATTN_DECODE(NAME, D, KV)                                                                    \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        NAME(float* part_o, float* part_ml, const __half* q, const void* k_cache, const void* v_cache,    \
             const float* k_scale, const float* v_scale, const int* lengths, int H, int Hkv, int L, int CS, \
             int C, float scale_log2) {                                                                    \
        pdl_enter_attention(NOT_EARLY);                                                                    \
        attn_decode<D, KV>(part_o, part_ml, q, k_cache, v_cache, k_scale, v_scale, lengths, H, Hkv, L,   \
                            CS, C, scale_log2);                                                            \
    }

FLLAMA_ATTN_DECODE(attn_decode_d64, 64, KV_F16)
FLLAMA_ATTN_DECODE(attn_decode_d128, 128, KV_F16)
FLLAMA_ATTN_DECODE(attn_decode_d64_kv8, 64, KV_I8)
FLLAMA_ATTN_DECODE(attn_decode_d128_kv8, 128, KV_I8)
FLLAMA_ATTN_DECODE(attn_decode_d64_kvf8, 64, KV_F8)
FLLAMA_ATTN_DECODE(attn_decode_d128_kvf8, 128, KV_F8)

// (out fp16 [B,H,D], part_o, part_ml, lengths, int H, int L, int CS, int C, int D)
extern "C" __global__ void __launch_bounds__(128)
    attn_decode_combine(__half* out, const float* part_o, const float* part_ml, const int* lengths, int H,
                        int L, int CS, int C, int D) {
    pdl_enter_attention(NOT_EARLY);
    const int bh = blockIdx.x, b = bh / H, d = threadIdx.x;
    const int len = min(lengths[b], L);
    const int n = len > 0 ? (len + CS - 1) / CS : 0;
    if (d >= D) return;
    if (n == 0) {  // an empty row attends to nothing: zeros rather than NaN
        out[(size_t)bh * D + d] = __float2half_rn(0.0f);
        return;
    }
    const float* ml = part_ml + (size_t)bh * C * 2;
    float m = -INFINITY;
    for (int c = 0; c < n; ++c) m = fmaxf(m, ml[2 * c]);
    float l = 0.0f, acc = 0.0f;
    for (int c = 0; c < n; ++c) {
        const float w = exp2f(ml[2 * c] - m);
        l += w * ml[2 * c + 1];
        acc += w * part_o[((size_t)bh * C + c) * D + d];
    }
    out[(size_t)bh * D + d] = __float2half_rn(acc / l);
}

// ==== fused single-launch variant ====================================================================
// attn_fused_d{64,128}[_kv8|_kvf8]: the same tensor-core tiles, reorganised for bandwidth and with the combine
// (and optionally the per-token int8 quantization of the output) done by the last block to finish.
//   grid (S splits, B * Hkv * HG units), block 128 (4 warps). A unit is (row b, kv head, group of <= 8
//   query heads). Its row's tiles of 16 positions are split evenly over the first n <= S blocks at run
//   time, from lengths[b] read on the device (tps = ceil(tiles / S) tiles per block, or span_tiles when
//   the launcher fixes the chunk), so one launch shape serves every step and no block idles while
//   another streams the whole context.
//   1. cp.async streams the block's K and V (and 8-bit scales) into shared memory in stages of 64
//      positions, double buffered: every thread has a whole stage of 16-byte copies in flight while the
//      warps work on the previous one. Copies past the block's end are zero-filled (the cache may hold
//      NaN there).
//   2. warp w takes tile w of each stage: S = K Q^T with A from ldmatrix (fp16) or converted 8-bit rows,
//      online softmax per head (running max m, lane-partial sum l, accumulators rescaled by 2^(m_old -
//      m_new)), P rounded to fp16 through a warp-private transpose buffer, O^T += V^T P^T with A from
//      ldmatrix.trans (fp16) or the prmt transpose of converted 8-bit rows (int8 and e4m3 differ only in the
//      conversion, kv_codes.cuh).
//   3. the 4 warps' (m, l, O) merge in shared memory. A unit with one active block writes out = O / l.
//      Otherwise the block writes (O, m, l) to the workspace, fences, and bumps the unit's counter; the
//      block that brings it to n resets it to 0 (so a CUDA graph needs no memset node) and combines the
//      n partials in split order (deterministic, whichever block is last).
//   4. int8 output: static amax -> each unit's finishing block quantizes its own heads; dynamic ->
//      after writing its heads' fp16 output the finishing block bumps the row's counter, and the row's
//      last block reads the row's H * D fp16 values back (L2), takes amax and quantizes, so q_out equals
//      quantize_ref(out) bit for bit. Or (amax_part) no quantization here: the finishing block writes its
//      unit's max |out|, and the o_proj GEMV quantizes (int8_gemm.cu, XqHook).
//   counters int32 [units + B], zero before the first launch, zero again after every launch.
// *_cl entries (CL): the same kernel launched in thread-block clusters of S blocks (cluster dims (S, 1, 1), S
//   <= 16), one cluster per unit, for the small-batch grids where a unit has several blocks (LLaMA-2-7B at
//   batch 1: S = 10, the most whose 32 clusters are all resident at once; attention_decode.py picks S).
//   Step 3 then needs no global round trips: each block leaves its (O, m, l) in its own
//   shared memory, the cluster meets at a barrier (release / acquire), block 0 reads the partials through
//   distributed shared memory (ld.shared::cluster: every thread issues all its loads at once, one round trip)
//   and combines them in split order (the same arithmetic as the workspace path, so the same bits), and a
//   second barrier keeps every block's shared memory alive until block 0 has read it. No fence, no counter,
//   no workspace. Push mode, where block 0's range is one stage (short contexts, the common decode case) and the
//   partials fit in the shared memory it leaves unused (Geom::PUSH_OFF): each other block stores its partial
//   into block 0's shared memory by st.async, each store completing its bytes on block 0's mbarrier, and exits at
//   once; block 0 waits on that barrier for all the bytes and combines from its own shared memory, with no remote
//   round trip, no second cluster barrier and no fence (a release arrival on the cluster barrier is a GPU-scope
//   MEMBAR that waits for every store in flight: ~0.6 us a layer). Blocks past
//   the row's end exit at once: a cluster barrier waits only for threads that have not exited (PTX ISA), and
//   nothing reads their shared memory.
// RoPE mode (qkv non-null; q unused): the kernel takes the fused QKV GEMV output and does rope_kv.cu's work
//   for the new token of each row, bit for bit, so the decode step needs no rope_kv launch. Row b's new
//   token sits at p = lengths[b] - 1 (cache row b). Stage 0's copies go out before the PDL wait (they read
//   rows that earlier steps wrote, never p's: see below), so in steps whose kernels trigger early (common.cuh,
//   trigger 4) they stream under the q|k|v GEMV's tail. Every block rotates the query heads it needs itself,
//   once its stage-0 copies are issued (the loads' latency then overlaps the stream). The unit's last
//   active block (its range ends at the row's length, so its last stage holds p) rotates k, quantizes k
//   and v for an 8-bit cache, and stores them at p. When p's stage is stage 0 (the only one: short contexts,
//   the common decode case) p gets no copy and the same bytes go straight into the stage's row, so this
//   block, which every cluster waits for, issues its copies without first waiting for the store (else it
//   trails the others); with more stages the store happens while stage 0 streams and the loop's barriers
//   order it before the last stage's copies. Head groups of one kv head (HG > 1) each store the same
//   bytes, so no block reads another block's store. rope_kv's guards with pos = p: p outside the cos/sin
//   table -> q = 0 and no store; p >= L or an empty row -> no store.
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

namespace fused {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int STAGE = WARPS * 16;  // positions per pipeline stage: one 16-position tile per warp
constexpr int NBUF = 2;            // stages resident in shared memory
constexpr int PH_STRIDE = 24;      // halves per head row of a warp's P tile: conflict-free reads and writes
constexpr int MAX_SPLITS = 512;
constexpr int CLUSTER_MAX = 16;  // blocks per cluster (non-portable above 8; H100 / H200 allow 16)

// A float in block `rank`'s shared memory at the address `p` has in this block's (same kernel, same layout).
__device__ __forceinline__ float ld_cluster(const float* p, int rank) {
    const uint32_t remote = cluster_map((uint32_t)__cvta_generic_to_shared(p), rank);
    float v = 0.0f;
    FLLAMA_CLUSTER_ASM("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

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

template <int D, int KV, bool CL>
__device__ __forceinline__ void attn_fused(__half* __restrict__ out, int8_t* __restrict__ q_out,
                                           float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                           float* __restrict__ amax_part,
                                           float* __restrict__ part_o, float* __restrict__ part_ml,
                                           int* __restrict__ counters, const __half* __restrict__ q,
                                           const __half* __restrict__ qkv, const float* __restrict__ cos_sin,
                                           void* __restrict__ k_cache, void* __restrict__ v_cache,
                                           float* __restrict__ k_scale, float* __restrict__ v_scale,
                                           const int* __restrict__ lengths, int H, int Hkv, int L, int S,
                                           int span_tiles, int max_pos, float scale_log2) {
    constexpr bool KV8 = KV != KV_F16;  // 8-bit codes with scales: one layout for int8 and e4m3
    using G = Geom<D, KV8>;
    constexpr int MT = D / 16;  // 16-dim tiles of the output, 16-dim k steps of the scores
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_last;
    __shared__ float s_red[32];
    __shared__ float s_l[SLOTS];
    __shared__ __align__(8) uint64_t s_push;  // CL push mode: block 0's mbarrier, completed by the pushed bytes
    __shared__ float2 s_pml[CLUSTER_MAX - 1][SLOTS];  // CL push mode: (m, l) of splits 1.. in block 0

    if (dynamic_smem_size() < (uint32_t)G::SMEM) __trap();  // the launcher disagrees with this layout
    const int R = H / Hkv, HG = (R + SLOTS - 1) / SLOTS;
    const int units = gridDim.y, u = blockIdx.y, split = blockIdx.x;
    const int rows = units / (HG * Hkv);  // the batch's rows, for the PDL trigger
    // The PDL wait: at once, except in RoPE mode (qkv), which issues its first stage's copies before it (below).
    // lengths and the cache may be read before it: the kernels that wrote them had completed when the kernel
    // before this one (the q|k|v GEMV) passed its own wait, and it lets this one start only after that.
    if (qkv == nullptr) pdl_enter_attention(rows);
    const int hg = u % HG, kvh = (u / HG) % Hkv, b = u / (HG * Hkv);
    const int len_b = lengths[b];
    const int len = min(max(len_b, 0), L);
    const int ntiles = (len + 15) / 16;
    const int tps = span_tiles > 0 ? span_tiles : max(1, (ntiles + S - 1) / S);
    const int n_act = len > 0 ? (ntiles + tps - 1) / tps : 1;  // an empty row: block 0 writes zeros
    attn_stamp(1);
    // CL: nothing reads an idle block's shared memory, and the cluster's barriers wait only for threads that have
    // not exited, so it leaves at once (its exit also counts as its PDL trigger)
    if (split >= n_act) return;  // whole block, before any barrier

    const int slots = min(SLOTS, R - hg * SLOTS), head0 = kvh * R + hg * SLOTS;
    // CL push mode, where block 0's range is one stage and the partials fit beside it: each other block stores its
    // partial straight into block 0's shared memory (Geom::PUSH_OFF and s_pml) by st.async and exits; block 0 waits
    // on its mbarrier s_push for the bytes and combines from its own shared memory (push_combine). That saves the
    // pull's DSMEM round trip and the second barrier, which keeps every block until block 0 has read it. The cluster
    // barrier's one phase, arrived at here, says that every block has started and that block 0's mbarrier is
    // initialized: shared memory may be written remotely only then.
    const bool push = CL && n_act > 1 && min(tps * 16, len) <= STAGE &&
                      (n_act - 1) * slots * D * 4 <= G::PUSH_BYTES;  // the same in every block of the unit
    if (push) {
        if (split == 0) {
            if (threadIdx.x == 0) {  // before the phase-1 arrival; its one arrival announces every byte
                mbar_init_cluster(smem_addr(&s_push), 1);
                mbar_expect_tx(smem_addr(&s_push), (n_act - 1) * slots * (D + 2) * 4);
            }
            for (int i = threadIdx.x; i < (CLUSTER_MAX - 1) * SLOTS; i += THREADS)  // the splits past the unit's
                if (i / SLOTS >= n_act - 1) s_pml[i / SLOTS][i % SLOTS] = make_float2(-INFINITY, 0.0f);
        }
        cluster_arrive_relaxed();
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const size_t row0 = ((size_t)b * Hkv + kvh) * L;
    float* wo = reinterpret_cast<float*>(smem);  // merge area [WARPS][SLOTS][D], then m, l [WARPS][SLOTS]
    float* wm = wo + WARPS * SLOTS * D;
    float* wl = wm + WARPS * SLOTS;

    if (len > 0) {
        const int lo = split * tps * 16, hi = min(lo + tps * 16, len);
        const int nstages = (hi - lo + STAGE - 1) / STAGE;
        // RoPE mode: the new token's position (>= 0 as len > 0) and its cos/sin row (max_pos is 0 otherwise)
        const int p_new = len_b - 1;
        const bool rot_ok = p_new < max_pos;
        const float* cs_row = cos_sin + (size_t)(rot_ok ? p_new : 0) * D;
        __half* ph = reinterpret_cast<__half*>(smem + NBUF * G::BUF_BYTES) + warp * SLOTS * PH_STRIDE;

        const bool new_kv = qkv != nullptr && split == n_act - 1 && rot_ok && p_new < L;  // block-uniform
        // p's stage: the only one when nstages == 1, else the last. With one stage the block writes p's row into
        // it directly (after issuing the copies of the others): the last block, on every cluster's critical
        // path, then waits for no L2 round trip before its copies. With more, p's row is stored during stage 0
        // and the copies of the last stage, issued after a loop barrier, read it back.
        const int skip = new_kv && nstages == 1 ? p_new : -1;
#pragma unroll
        for (int s = 0; s < NBUF - 1; ++s) {
            if (s < nstages)
                issue_stage<D, KV8>(smem + s * G::BUF_BYTES, k_cache, v_cache, k_scale, v_scale, row0,
                                    lo + s * STAGE, hi, skip);
            cp_async_commit();
        }
        // RoPE mode: these copies read only cache rows that earlier steps wrote (the new token's row is skipped, or
        // in a later stage, copied after its store), so they go out before the PDL wait and stream while the q|k|v
        // GEMV finishes; the query, the new k and v and everything this kernel writes come after the wait.
        if (qkv != nullptr) pdl_enter_attention(rows);
        attn_stamp(12);
        // the query heads as the B operand, in the k order the K fragments come in (raw in RoPE mode, rotated
        // once the stage-0 copies are issued)
        uint32_t qb[MT][2], qp[MT][2];
        uint4 cs4;
        {
            const bool qok = g < slots;
            const int qh = head0 + (qok ? g : 0);
            const __half* qrow = qkv != nullptr ? qkv + ((size_t)b * (H + 2 * Hkv) + qh) * D
                                                : q + ((size_t)b * H + qh) * D;
#pragma unroll
            for (int st = 0; st < MT; ++st) {
                if (KV8) {  // lane t's dims [t D/4, (t + 1) D/4) as pairs, word 2 st and 2 st + 1
                    const uint2 w = ld_cached8(qrow + t * (D / 4) + 4 * st, qok);
                    qb[st][0] = w.x;
                    qb[st][1] = w.y;
                } else {  // natural: dims 16 st + 2t (+1) and 16 st + 8 + 2t (+1)
                    qb[st][0] = qok ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * st + 2 * t)) : 0u;
                    qb[st][1] = qok ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * st + 8 + 2 * t)) : 0u;
                }
            }
            if (qkv != nullptr) rope_query_load<D, KV8>(qp, cs4, qrow, qok, cs_row, lane);
        }
        Half8 kv_lo, kv_hi;  // warp 0 of the new token's block: its k and v chunks, loaded with the query
        if (new_kv && warp == 0) {
            const __half* k_src = qkv + ((size_t)b * (H + 2 * Hkv) + H + kvh) * D;  // v: Hkv * D further
            load_new_kv<D>(k_src, k_src + (size_t)Hkv * D, kv_lo, kv_hi);
        }
        auto store_kv = [&] {  // warp 0
            store_new_kv<D, KV>(kv_lo, kv_hi, cs_row, k_cache, v_cache, k_scale, v_scale, row0 + p_new,
                                 skip >= 0 ? smem : nullptr, p_new - lo);
        };

        float o[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) o[mt][r] = 0.0f;
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // heads 2t, 2t + 1

        if (qkv != nullptr) rope_query<D, KV8>(qb, qp, cs4, rot_ok, ph, lane);
        attn_stamp(13);
        if (new_kv && warp == 0) store_kv();  // before the loop's first barrier, which orders p's stage row
        attn_stamp(2);
        if (push) cluster_wait_acquire();  // block 0 has started and set up s_push (long since): under the copies
        attn_stamp(10);
        for (int s = 0; s < nstages; ++s) {
            cp_async_wait<NBUF - 2>();
            __syncthreads();  // stage s landed for every thread; every warp is done with stage s - 1
            if (s == 0) attn_stamp(3);
            {
                const int sn = s + NBUF - 1;
                if (sn < nstages)
                    issue_stage<D, KV8>(smem + (sn % NBUF) * G::BUF_BYTES, k_cache, v_cache, k_scale, v_scale,
                                        row0, lo + sn * STAGE, hi);
                cp_async_commit();  // possibly empty: keeps the group count uniform
            }
            const int t0 = lo + s * STAGE + 16 * warp;  // this warp's tile
            if (t0 >= hi) continue;                    // warp-uniform
            const unsigned char* kt = smem + (s % NBUF) * G::BUF_BYTES + 16 * warp * G::ROW;
            const unsigned char* vt = kt + G::KV_BYTES;
            const float* ksc = reinterpret_cast<const float*>(smem + (s % NBUF) * G::BUF_BYTES + 2 * G::KV_BYTES) +
                               16 * warp;

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
        cp_async_wait<0>();
        __syncthreads();  // the stage buffers become the merge area
        attn_stamp(4);

#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            l0 += __shfl_xor_sync(FULL_MASK, l0, off);
            l1 += __shfl_xor_sync(FULL_MASK, l1, off);
        }
        // only the unit's head slots: with one query head per kv head (no GQA) that is 1 lane in 4 and half
        // its values, so the stores of lanes t = 0..3 (same bank, D floats apart) do not conflict
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int slot = 2 * t + (r & 1);
                if (slot < slots) wo[(warp * SLOTS + slot) * D + acc_dim<D, KV8>(mt, r, g)] = o[mt][r];
            }
        if (g == 0) {
            wm[warp * SLOTS + 2 * t] = m0;
            wm[warp * SLOTS + 2 * t + 1] = m1;
            wl[warp * SLOTS + 2 * t] = l0;
            wl[warp * SLOTS + 2 * t + 1] = l1;
        }
        __syncthreads();
        attn_stamp(9);
    } else if (qkv != nullptr) {
        pdl_enter_attention(rows);  // an empty row streams nothing, but the writes below wait
    }

    // the block's result per (head slot, dim): final when the unit has one block, else a partial
    const size_t out_row = (size_t)b * H * D;  // out / q_out offset of row b
    const bool quant_static = q_out != nullptr && static_amax != nullptr;
    const float inv_static = quant_static ? __fdiv_rn(127.0f, clamp_amax(*static_amax)) : 0.0f;
    float out_amax = 0.0f;  // max |out| of the values this thread wrote (amax_part)
    auto emit = [&](int h, int d, __half y) {  // a final output value: fp16, its max, its static quantization
        const size_t o = out_row + (size_t)(head0 + h) * D + d;
        out[o] = y;
        out_amax = fmaxf(out_amax, fabsf(__half2float(y)));
        if (quant_static) q_out[o] = quantize_i8(__half2float(y), inv_static);
    };
    if (push) {  // block 0 combines in its own shared memory; the others push their partials there and exit
        const bool block0 = push_combine<D>(wo, wm, wl, reinterpret_cast<float*>(smem + G::PUSH_OFF), s_pml,
                                            smem_addr(&s_push), slots, split, n_act, emit);
        attn_stamp(block0 ? 11 : 5);
        attn_stamp(7);
        if (!block0) return;
    } else {
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
            return;  // not the unit's last block
        }
        if (CL && n_act > 1) {
            if (split == 0) attn_stamp(7);
            cluster_sync();  // block 0 has read every partial: the others may exit
            if (split != 0) {
                attn_stamp(7);
                return;
            }
        }
    }

    // this block finished its unit's heads
    if (amax_part != nullptr) {  // the unit's max |out|, for an int8 o_proj that quantizes its input itself
        const float m = block_max(out_amax, s_red);
        if (tid == 0) amax_part[u] = m;  // [B, Hkv * HG] flattened: unit u of row b is b * Hkv * HG + ...
        return;
    }
    if (q_out == nullptr) return;
    if (quant_static) {
        if (tid == 0 && kvh == 0 && hg == 0) a_scale[b] = __fdiv_rn(clamp_amax(*static_amax), 127.0f);
        return;
    }
    if (!last_block_arrives(&counters[units + b], Hkv * HG, s_last)) return;
    // the row's last unit: per-token dynamic quantization over all H * D values (quantize.cu's rule)
    const uint4* row = reinterpret_cast<const uint4*>(out + out_row);
    const int nvec = H * D / 8;
    float amax = 0.0f;
    for (int c = tid; c < nvec; c += THREADS) {
        const uint4 v = __ldcg(row + c);
        amax = fmaxf(amax, half8_absmax(*reinterpret_cast<const Half8*>(&v)));
    }
    float inv, scale;
    amax_scales(block_max(amax, s_red), inv, scale);
    for (int c = tid; c < nvec; c += THREADS) {
        const uint4 v = __ldcg(row + c);
        quantize_store8(q_out + out_row + 8 * c, *reinterpret_cast<const Half8*>(&v), inv);
    }
    if (tid == 0) a_scale[b] = scale;
}

}  // namespace fused

// (out fp16 [B,H,D], q_out int8 [B,H*D] or null, a_scale f32 [B] or null, static_amax f32 [1] or null,
//  amax_part f32 [B, Hkv * HG] or null (q_out null: each unit's max |out|),
//  part_o f32 [B,H,S,D], part_ml f32 [B,H,S,2], counters i32 [units + B] (zero), q fp16 [B,H,D] or null,
//  qkv fp16 [B,(H+2Hkv)*D] or null (RoPE mode), cos_sin f32 [max_pos,D] or null,
//  k_cache, v_cache [B,Hkv,L,D] fp16 / int8 / e4m3, k_scale, v_scale f32 [B,Hkv,L] or null, lengths i32 [B],
//  int H, int Hkv, int L, int S, int span_tiles (0: split the length evenly over S), int max_pos,
//  float scale_log2)
// grid (S, B * Hkv * ceil(H / Hkv / 8)), block 128, dynamic shared memory Geom<D, KV8>::SMEM.
// MINB: resident blocks per SM the launcher counts on (d128 fp16: shared memory allows 3; others 4).
#define FLLAMA_ATTN_FUSED(NAME, D, KV, MINB) FLLAMA_ATTN_FUSED_CL(NAME, D, KV, MINB, false) \
    FLLAMA_ATTN_FUSED_CL(NAME##_cl, D, KV, MINB, true)
#define FLLAMA_ATTN_FUSED_CL(NAME, D, KV, MINB, CL)                                                         \
    extern "C" __global__ void __launch_bounds__(fused::THREADS, MINB)                                      \
        NAME(__half* out, int8_t* q_out, float* a_scale, const float* static_amax, float* amax_part,       \
             float* part_o,                                                                                 \
             float* part_ml, int* counters, const __half* q, const __half* qkv, const float* cos_sin,       \
             void* k_cache, void* v_cache, float* k_scale, float* v_scale, const int* lengths, int H, int Hkv, \
             int L, int S, int span_tiles, int max_pos, float scale_log2) {                                \
        attn_stamp(0);                                                                                     \
        fused::attn_fused<D, KV, CL>(out, q_out, a_scale, static_amax, amax_part, part_o, part_ml, counters, q, \
                                  qkv,                                                                     \
                                  cos_sin, k_cache, v_cache, k_scale, v_scale, lengths, H, Hkv, L, S,      \
                                  span_tiles, max_pos, scale_log2);                                        \
    }

FLLAMA_ATTN_FUSED(attn_fused_d64, 64, KV_F16, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128, 128, KV_F16, 3)
FLLAMA_ATTN_FUSED(attn_fused_d64_kv8, 64, KV_I8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128_kv8, 128, KV_I8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d64_kvf8, 64, KV_F8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128_kvf8, 128, KV_F8, 4)
