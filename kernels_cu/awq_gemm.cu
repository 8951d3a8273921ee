// AWQ W4A16 in AutoAWQ's GEMM layout: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N].
// w_hat[k, n] = (q - z) * s in fp16 (q - z exact, one rounding for the product); y = x @ w_hat, fp32 sums.
//
// awq_gemm_mt{1,2}: small-M kernel reading the packed layout directly (decode and short prompts), one launch.
//   A warp owns a strip of 256 output columns: lane (g, t) copies the 4 packed words (32 columns) at word
//   column 32 * strip + 4g of rows k0 + 4t .. k0 + 4t + 3 (four 16-byte cp.async per 16-row k tile; the 8
//   lanes of one t read 128 contiguous bytes of a row) into its own slots of a STAGES-deep shared-memory
//   ring, so STAGES - 1 tiles (6 KB per warp) stay in flight while it computes, without holding registers.
//   A lane reads back only what it copied itself: cp.async.wait_group alone orders it, no barrier.
//   prmt of the words of rows (4t, 4t+1) and (4t+2, 4t+3) interleaves them so that LOP3 gives k-pairs of one
//   column (awq_dequant_kpairs): exactly the A fragment of an m16n8k16 mma whose rows g / g + 8 are columns
//   2j / 2j + 1 of word w and whose k order is (4t, 4t+1 | 4t+2, 4t+3); the B fragment (tokens) is the
//   lane's 4 consecutive activations of token g, one 8-byte load. 16 mma per tile per 8 tokens.
//   Block = 4 warps on one strip, splitting the block's k range; they meet in shared memory (the ring's
//   space, reused). The blocks of a strip (grid.y splits) write fp32 partials [splits, M, N]; the last
//   of them to finish (an atomic counter per strip, reset by that block) sums the partials in split
//   order (deterministic), rounds to fp16, adds the residual and writes y: no second launch.
//   grid (ceil(N / 256), splits, ceil(M / (8 * MT))), block 128.
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

constexpr int STAGES = 4;  // ring depth: STAGES - 1 tiles in flight per warp

// The current group's zero terms and scales per column, both halves equal (awq_dequant_kpairs):
// [word][o][j] belongs to column 8 (c + word) + 2j + o.
struct GroupCols {
    __half2 zz[4][2][4];
    __half2 s[4][2][4];
};

__device__ __forceinline__ void load_group_cols(GroupCols& gc, const uint32_t* __restrict__ qzeros,
                                                const __half* __restrict__ scales, int grp, int words, int N,
                                                int c, bool ok) {
    const uint4 zw = ld_cached(qzeros + (size_t)grp * words + c, ok);
    uint4 sv[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) sv[w] = ld_cached(scales + (size_t)grp * N + 8 * (c + w), ok);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        __half2 zp[4];  // pair j = columns (2j, 2j + 1)
        awq_zero_terms(word(zw, w), zp);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const __half2 sp = bits_h2(word(sv[w], j));
            gc.zz[w][0][j] = __low2half2(zp[j]);
            gc.zz[w][1][j] = __high2half2(zp[j]);
            gc.s[w][0][j] = __low2half2(sp);
            gc.s[w][1][j] = __high2half2(sp);
        }
    }
}

template <int MT>
__device__ __forceinline__ void awq_gemm(__half* __restrict__ y, float* __restrict__ partial,
                                         int* __restrict__ counters, const __half* __restrict__ residual,
                                         const __half* __restrict__ x,
                                         const uint32_t* __restrict__ qweight, const uint32_t* __restrict__ qzeros,
                                         const __half* __restrict__ scales, int M, int N, int K, int G,
                                         int tiles_per_warp) {
    constexpr int RING_BYTES = WARPS * STAGES * 4 * 32 * 16;
    constexpr int RED_BYTES = 2 * MT * 64 * 32 * 4;
    __shared__ __align__(16) unsigned char smem[RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES];
    __shared__ int is_last;
    auto ring = reinterpret_cast<uint4 (*)[STAGES][4][32]>(smem);  // [warp][stage][row 4t + r][lane]
    auto red = reinterpret_cast<float (*)[MT * 64][32]>(smem);     // [2][value][lane], after the loop

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
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = m0 + mt * 8 + g;
        x_ok[mt] = m < M;
        x_row[mt] = x + (size_t)(x_ok[mt] ? m : 0) * K + 4 * t;
    }

    float acc[MT][4][4][4];  // [token tile][word][column pair j][c0..c3]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int p = 0; p < 4; ++p)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[mt][w][p][r] = 0.0f;

    // Lanes past N (c_ok false) copy zeros; their mma rows are never written out. Tiles are whole (K % 16 == 0).
    const size_t tile_stride = (size_t)TILE_K * words;
    const uint32_t* qp = qweight + (size_t)(4 * t) * words + cc;
    auto issue = [&](int tile) {  // one commit group per tile, empty past the end (keeps the count uniform)
        if (tile < t_end) {       // warp-uniform
            const uint32_t* src = qp + (size_t)tile * tile_stride;
#pragma unroll
            for (int r = 0; r < 4; ++r) cp_async16(&ring[warp][tile % STAGES][r][lane], src + (size_t)r * words, c_ok);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(t_begin + s);

    const int tiles_per_group = G / TILE_K;  // G % 16 == 0: a tile never straddles two groups
    int grp = t_begin / tiles_per_group;
    int left = tiles_per_group - t_begin % tiles_per_group;  // tiles of this group still to come
    GroupCols gc;
    if (t_begin < t_end) load_group_cols(gc, qzeros, scales, grp, words, N, cc, c_ok);
    auto load_x = [&](int tile, uint2 (&xv)[MT]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[mt] = ld_cached8(x_row[mt] + tile * TILE_K, x_ok[mt] && tile < t_end);
    };
    uint2 xv[MT];
    load_x(t_begin, xv);
    for (int tile = t_begin; tile < t_end; ++tile) {
        cp_async_wait<STAGES - 2>();  // this lane's copies of `tile` have landed
        uint4 q[4];                    // rows 4t + r, words c .. c + 3
#pragma unroll
        for (int r = 0; r < 4; ++r) q[r] = ring[warp][tile % STAGES][r][lane];
        issue(tile + STAGES - 1);  // into the slot read one iteration ago
        uint2 xn[MT];
        load_x(tile + 1, xn);
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t r0 = word(q[0], w), r1 = word(q[1], w), r2 = word(q[2], w), r3 = word(q[3], w);
            uint32_t k01[2][4], k23[2][4];  // [o][j]: k-pairs (4t, 4t+1) / (4t+2, 4t+3) of column 2j + o
            awq_dequant_kpairs(prmt(r0, r1, 0x5410), gc.zz[w][0], gc.s[w][0], k01[0]);
            awq_dequant_kpairs(prmt(r0, r1, 0x7632), gc.zz[w][1], gc.s[w][1], k01[1]);
            awq_dequant_kpairs(prmt(r2, r3, 0x5410), gc.zz[w][0], gc.s[w][0], k23[0]);
            awq_dequant_kpairs(prmt(r2, r3, 0x7632), gc.zz[w][1], gc.s[w][1], k23[1]);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    mma_f16_16816(acc[mt][w][j], k01[0][j], k01[1][j], k23[0][j], k23[1][j], xv[mt].x, xv[mt].y);
        }
        if (--left == 0 && tile + 1 < t_end) {  // warp-uniform
            left = tiles_per_group;
            load_group_cols(gc, qzeros, scales, ++grp, words, N, cc, c_ok);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xv[mt] = xn[mt];
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring before it becomes `red`

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
    const size_t MN = (size_t)M * N;
    if (warp == 0) {
        add(0);
        if (c_ok) {
            float* out = partial + blockIdx.y * MN;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int ma = m0 + mt * 8 + 2 * t;  // c0/c2 belong to token ma, c1/c3 to ma + 1
#pragma unroll
                for (int w = 0; w < 4; ++w)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int n = 8 * (c + w) + 2 * j;
                        const float* a = acc[mt][w][j];
                        if (ma < M) *reinterpret_cast<float2*>(out + (size_t)ma * N + n) = make_float2(a[0], a[2]);
                        if (ma + 1 < M)
                            *reinterpret_cast<float2*>(out + (size_t)(ma + 1) * N + n) = make_float2(a[1], a[3]);
                    }
            }
        }
        __threadfence();  // partials visible GPU-wide before the counter says so
    }
    __syncthreads();
    int* counter = counters + blockIdx.z * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.y - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();

    // The strip's last block: y = fp16(sum of the partials in split order) (+ residual), 4 columns a thread.
    const int n0 = blockIdx.x * STRIP_WORDS * 8;
    const int rows = min(M - m0, 8 * MT), quads = min(STRIP_WORDS * 8, N - n0) / 4;
    for (int i = threadIdx.x; i < rows * quads; i += blockDim.x) {
        const size_t o = (size_t)(m0 + i / quads) * N + n0 + 4 * (i % quads);
        float4 s = __ldcg(reinterpret_cast<const float4*>(partial + o));  // L2: other SMs wrote these
        for (int k = 1; k < (int)gridDim.y; ++k) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(partial + k * MN + o));
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
        }
        __half2 lo = __floats2half2_rn(s.x, s.y), hi = __floats2half2_rn(s.z, s.w);
        if (residual != nullptr) {
            const uint2 r = *reinterpret_cast<const uint2*>(residual + o);
            lo = __hadd2_rn(lo, bits_h2(r.x));  // fp16 add after rounding, like the reference
            hi = __hadd2_rn(hi, bits_h2(r.y));
        }
        *reinterpret_cast<uint2*>(y + o) = make_uint2(h2_bits(lo), h2_bits(hi));
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (stream order)
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

// (y fp16 [M,N], partial f32 [splits,M,N], counters i32 [grid.x * grid.z] (zero; left zero), residual fp16
//  [M,N] or null, x fp16 [M,K], qweight i32 [K,N/8], qzeros i32 [K/G,N/8], scales fp16 [K/G,N],
//  int M, int N, int K, int G, int tiles_per_warp)
// ptxas lands at 168 / 255 registers (MT 1 / 2): 3 / 2 resident blocks, as gemm_shapes.AWQ_BLOCKS_PER_SM says.
// (A min-blocks bound of 3 makes it spill at MT = 1; without it the allocation already fits three.)
#define FLLAMA_AWQ_GEMM(NAME, MT)                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        NAME(__half* y, float* partial, int* counters, const __half* residual, const __half* x,           \
             const uint32_t* qweight, const uint32_t* qzeros, const __half* scales, int M, int N, int K,     \
             int G, int tiles_per_warp) {                                                                  \
        awq_gemm<MT>(y, partial, counters, residual, x, qweight, qzeros, scales, M, N, K, G, tiles_per_warp); \
    }

FLLAMA_AWQ_GEMM(awq_gemm_mt1, 1)
FLLAMA_AWQ_GEMM(awq_gemm_mt2, 2)

// (w_hat fp16 [K,N], qweight, qzeros, scales, int N, int K, int G); one thread per 32 columns of a row
extern "C" __global__ void __launch_bounds__(256)
    awq_dequant_kernel(__half* w_hat, const uint32_t* qweight, const uint32_t* qzeros, const __half* scales,
                       int N, int K, int G) {
    awq_dequant(w_hat, qweight, qzeros, scales, N, K, G);
}
