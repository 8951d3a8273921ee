// AWQ W4A16 in AutoAWQ's GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N].
// w_hat[k, n] = (q - z) * s in fp16 (q - z exact, one rounding for the product); y = x @ w_hat, fp32 sums.
//
// awq_gemm_mt{1,2}: small-M kernel reading the packed layout directly (decode and short prompts).
//   A warp owns a strip of 256 output columns: lane (g, t) loads the 4 packed words (32 columns) at word
//   column 32 * strip + 4g of rows k0 + 4t .. k0 + 4t + 3 (four 16-byte loads per 16-row k tile; the 8
//   lanes of one t read 128 contiguous bytes of a row). LOP3 turns each word into 4 fp16 pairs of adjacent
//   columns; a prmt 2x2 transpose of the pairs of rows (4t, 4t+1) and (4t+2, 4t+3) gives exactly the A
//   fragment of an m16n8k16 mma whose 16 rows are the column pairs (row g <- column 2p, row g + 8 <-
//   column 2p + 1 of word w) and whose k order is (4t, 4t+1 | 4t+2, 4t+3) -- the B fragment (tokens) is
//   then the lane's 4 consecutive activations of token g, one 8-byte load. 16 mma per tile per 8 tokens.
//   Block = 4 warps on one strip, splitting the block's k range; they meet in shared memory, and the
//   blocks of a strip (grid.y splits) write fp32 partials [splits, M, N] that awq_reduce sums in a fixed
//   order (deterministic, no atomics). grid (ceil(N / 256), splits, ceil(M / (8 * MT))), block 128.
// awq_reduce[_res]: partials -> fp16 y (+ residual); 4 columns per thread.
// awq_dequant: w_hat [K, N] fp16 for the prefill path (then a cuBLAS fp16 GEMM); same arithmetic.
#include "gemm_common.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 4;
constexpr int TILE_K = 16;
constexpr int STRIP_WORDS = 32;  // 256 columns per warp

struct GroupTerms {
    __half2 zz[4][4];  // [word][pair] zero terms (see awq_zero_terms)
    uint4 s[4];        // [word] scales of its 8 columns
};

__device__ __forceinline__ void load_group(GroupTerms& gt, const uint32_t* __restrict__ qzeros,
                                           const __half* __restrict__ scales, int grp, int words, int N, int c,
                                           bool ok) {
    const uint4 zw = ld_cached(qzeros + (size_t)grp * words + c, ok);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        awq_zero_terms(word(zw, w), gt.zz[w]);
        gt.s[w] = ld_cached(scales + (size_t)grp * N + 8 * (c + w), ok);
    }
}

template <int MT>
__device__ __forceinline__ void awq_gemm(float* __restrict__ partial, const __half* __restrict__ x,
                                         const uint32_t* __restrict__ qweight, const uint32_t* __restrict__ qzeros,
                                         const __half* __restrict__ scales, int M, int N, int K, int G,
                                         int tiles_per_warp) {
    __shared__ float red[2][MT * 64][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int words = N / 8;
    const int c = blockIdx.x * STRIP_WORDS + 4 * g;  // first of the lane's 4 words
    const bool c_ok = c < words;                      // N % 32 == 0: the 4 words are all in or all out
    const int cc = c_ok ? c : 0;
    const int m0 = blockIdx.z * 8 * MT;
    const int tiles = K / TILE_K;
    const int t_begin = (blockIdx.y * WARPS + warp) * tiles_per_warp;
    const int t_end = min(t_begin + tiles_per_warp, tiles);

    bool x_ok[MT];
    const __half* x_row[MT];
    token_rows<MT>(x, M, K, m0, g, 4 * t, x_ok, x_row);

    float acc[MT][4][4][4];  // [token tile][word][pair][c0..c3]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int p = 0; p < 4; ++p)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[mt][w][p][r] = 0.0f;

    // Lanes past N (c_ok false) load nothing and keep garbage: it only reaches their own mma rows,
    // whose results are never written. Tiles are whole (K % 16 == 0).
    const size_t tile_stride = (size_t)TILE_K * words;
    const uint32_t* qp = qweight + (size_t)(4 * t) * words + cc + (size_t)t_begin * tile_stride;
    auto load_tile = [&](const uint32_t* ptr, bool ok, uint4 (&q)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) q[r] = ld_stream_unfilled(ptr + (size_t)r * words, ok && c_ok);
    };

    const int tiles_per_group = G / TILE_K;  // G % 16 == 0: a tile never straddles two groups
    int grp = t_begin / tiles_per_group;
    int left = tiles_per_group - t_begin % tiles_per_group;  // tiles of this group still to come
    GroupTerms gt;
    if (t_begin < t_end) load_group(gt, qzeros, scales, grp, words, N, cc, c_ok);
    auto load_x = [&](int tile, uint2 (&xv)[MT]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[mt] = ld_cached8(x_row[mt] + tile * TILE_K, x_ok[mt] && tile < t_end);
    };
    uint4 q[4];
    uint2 xv[MT];
    load_tile(qp, t_begin < t_end, q);
    load_x(t_begin, xv);
    for (int tile = t_begin; tile < t_end; ++tile) {
        uint4 qn[4];
        uint2 xn[MT];
        load_tile(qp + tile_stride, tile + 1 < t_end, qn);  // one tile ahead (see int8_gemm.cu)
        load_x(tile + 1, xn);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            uint32_t wh[4][4];  // [row 4t + r][column pair]
#pragma unroll
            for (int r = 0; r < 4; ++r) awq_dequant_word(word(q[r], w), gt.zz[w], gt.s[w], wh[r]);
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const uint32_t a0 = pair_lo(wh[0][p], wh[1][p]), a1 = pair_hi(wh[0][p], wh[1][p]);
                const uint32_t a2 = pair_lo(wh[2][p], wh[3][p]), a3 = pair_hi(wh[2][p], wh[3][p]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_f16_16816(acc[mt][w][p], a0, a1, a2, a3, xv[mt].x, xv[mt].y);
            }
        }
        if (--left == 0 && tile + 1 < t_end) {  // warp-uniform
            left = tiles_per_group;
            load_group(gt, qzeros, scales, ++grp, words, N, cc, c_ok);
        }
        qp += tile_stride;
#pragma unroll
        for (int r = 0; r < 4; ++r) q[r] = qn[r];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[mt] = xn[mt];
    }

    // Fixed-order tree over the 4 warps: (w0 + w2) + (w1 + w3).
    auto store = [&](int buf) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 64; ++i) red[buf][mt * 64 + i][lane] = acc[mt][i >> 4][(i >> 2) & 3][i & 3];
    };
    auto add = [&](int buf) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[mt][i >> 4][(i >> 2) & 3][i & 3] += red[buf][mt * 64 + i][lane];
    };
    if (warp >= 2) store(warp - 2);
    __syncthreads();
    if (warp < 2) add(warp);
    __syncthreads();
    if (warp == 1) store(0);
    __syncthreads();
    if (warp != 0) return;
    add(0);

    if (!c_ok) return;
    float* out = partial + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ma = m0 + mt * 8 + 2 * t;  // c0/c2 belong to token ma, c1/c3 to ma + 1
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int n = 8 * (c + w) + 2 * p;
                const float* a = acc[mt][w][p];
                if (ma < M) *reinterpret_cast<float2*>(out + (size_t)ma * N + n) = make_float2(a[0], a[2]);
                if (ma + 1 < M) *reinterpret_cast<float2*>(out + (size_t)(ma + 1) * N + n) = make_float2(a[1], a[3]);
            }
    }
}

template <bool RESIDUAL>
__device__ __forceinline__ void awq_reduce(__half* __restrict__ y, const float* __restrict__ partial,
                                           const __half* __restrict__ residual, int M, int N, int splits) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;  // N % 4 == 0
    const size_t MN = (size_t)M * N;
    if (i >= MN) return;
    float4 s = *reinterpret_cast<const float4*>(partial + i);
    for (int k = 1; k < splits; ++k) {
        const float4 v = *reinterpret_cast<const float4*>(partial + k * MN + i);
        s.x += v.x;
        s.y += v.y;
        s.z += v.z;
        s.w += v.w;
    }
    __half2 lo = __floats2half2_rn(s.x, s.y), hi = __floats2half2_rn(s.z, s.w);
    if (RESIDUAL) {
        const uint2 r = *reinterpret_cast<const uint2*>(residual + i);
        lo = __hadd2_rn(lo, bits_h2(r.x));  // fp16 add after rounding, like the reference
        hi = __hadd2_rn(hi, bits_h2(r.y));
    }
    *reinterpret_cast<uint2*>(y + i) = make_uint2(h2_bits(lo), h2_bits(hi));
}

__device__ __forceinline__ void awq_dequant(__half* __restrict__ w_hat, const uint32_t* __restrict__ qweight,
                                            const uint32_t* __restrict__ qzeros, const __half* __restrict__ scales,
                                            int N, int K, int G) {
    const int quads = N / 32;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)K * quads) return;
    const int k = (int)(i / quads), c = 4 * (int)(i % quads), words = N / 8;
    const uint4 q = ld_stream(qweight + (size_t)k * words + c, true);
    GroupTerms gt;
    load_group(gt, qzeros, scales, k / G, words, N, c, true);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        uint32_t out[4];
        awq_dequant_word(word(q, w), gt.zz[w], gt.s[w], out);
        *reinterpret_cast<uint4*>(w_hat + (size_t)k * N + 8 * (c + w)) = make_uint4(out[0], out[1], out[2], out[3]);
    }
}

}  // namespace

// (partial f32 [splits,M,N], x fp16 [M,K], qweight i32 [K,N/8], qzeros i32 [K/G,N/8], scales fp16 [K/G,N],
//  int M, int N, int K, int G, int tiles_per_warp)
#define FLLAMA_AWQ_GEMM(NAME, MT)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        NAME(float* partial, const __half* x, const uint32_t* qweight, const uint32_t* qzeros,            \
             const __half* scales, int M, int N, int K, int G, int tiles_per_warp) {                       \
        pdl_enter();                                                                                       \
        awq_gemm<MT>(partial, x, qweight, qzeros, scales, M, N, K, G, tiles_per_warp);                     \
    }

FLLAMA_AWQ_GEMM(awq_gemm_mt1, 1)
FLLAMA_AWQ_GEMM(awq_gemm_mt2, 2)

// (y fp16 [M,N], partial f32 [splits,M,N], residual fp16 [M,N] or null, int M, int N, int splits)
extern "C" __global__ void __launch_bounds__(256)
    awq_reduce_plain(__half* y, const float* partial, const __half* residual, int M, int N, int splits) {
    pdl_enter();
    awq_reduce<false>(y, partial, residual, M, N, splits);
}

extern "C" __global__ void __launch_bounds__(256)
    awq_reduce_res(__half* y, const float* partial, const __half* residual, int M, int N, int splits) {
    pdl_enter();
    awq_reduce<true>(y, partial, residual, M, N, splits);
}

// (w_hat fp16 [K,N], qweight, qzeros, scales, int N, int K, int G); one thread per 32 columns of a row
extern "C" __global__ void __launch_bounds__(256)
    awq_dequant_kernel(__half* w_hat, const uint32_t* qweight, const uint32_t* qzeros, const __half* scales,
                       int N, int K, int G) {
    pdl_enter();
    awq_dequant(w_hat, qweight, qzeros, scales, N, K, G);
}
