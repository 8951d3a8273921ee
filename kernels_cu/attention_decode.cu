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
// The one-launch form of the same tiles, which the engine runs, is attention_fused.cu (this: fused=False).
#include "attention_common.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 4;
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
