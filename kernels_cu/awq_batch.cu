// AWQ W4A16 GEMM for decode batches (the engine takes it at 17-64 tokens) on the engine's int4 layout (awq_layout.cuh; awq_gemv.py
// packs it): y[m, n] = sum over groups of s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[m, k].
//
// Why not awq_gemv.cu at these sizes: its block is one 16-channel panel whose warps split K, so every panel
// reads all the activations again (at 32 tokens 256 KB per panel against the panel's 32 KB of weights: the
// q|k|v GEMV moves 106 MB through L2 for 27 MB of weights) and each warp waits for them at the start of its
// step (DRAM at 15% of peak, tensor pipe at 16%). Here:
//   block = 4 panels (64 channels) over the same k tiles and 8 * MT tokens; warp (p, half) computes panel p
//   for one half of the token tiles (4 warps at MT = 1, 8 from MT = 2: token_halves below);
//   a stage = one 128-k tile: the 8 * MT token rows of activations (MT x 2 KB), the 4 panels' weights
//   (4 KB) and group terms, copied to shared memory with cp.async STAGES - 1 tiles ahead, so the weights
//   stream without registers and the warps share one copy of the activations;
//   lane (g, t)'s B fragment of mma j is 8 bytes of its token row at the lane's k run (the layout's k order:
//   lane t's 32 k's of a tile are its runs of each group), read as 16-byte pieces from a row whose 16-byte
//   chunks are permuted (swz below) so that the 8 lanes of a quarter-warp hit 8 distinct bank groups.
// K is split over gridDim.y blocks when the panels alone give too few blocks (o_proj, down_proj): each block
// writes fp32 partial sums, the last of a column to finish (a counter, threadFenceReduction) adds them in
// split order (deterministic) and runs the epilogue; with one split the warps write the output directly.
//
// EPI 0: y fp16 [M, N];  1: + residual (fp16 add after rounding);  2: SwiGLU of a gate|up panel interleaved
// by 8: y [M, N / 2] = fp16(silu(fp16 gate)) * fp16 up (awq_gemv.cu's rounding).
// Entry points awq_batch_mt{MT}_g{GPT}_{plain|res|silu}(y, x, packed, terms, residual, partial, counters,
//   M, N, K, tiles, tiles_per_split); grid (N / 64, splits, ceil(M / (8 MT))), block 128 * token_halves,
//   dynamic shared memory STAGES * stage bytes (awq_batch.py).
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 4;  // = panels per block
constexpr int TILE_K = 128;
constexpr int TILE_WORDS = 256;  // 1 KB
constexpr int CHUNKS = TILE_K / 8;  // 16-byte pieces of a token row's tile
constexpr int STAGES = 4;

template <int MT, int GPT>
struct Stage {
    uint4 x[MT * 8][CHUNKS];       // token rows, chunks permuted by swz
    uint4 w[WARPS][TILE_WORDS / 4];  // the panels' tiles as stored: [h][lane] 16 bytes
    uint2 tm[WARPS][GPT][8];       // terms of (panel, group run, g): (row g, row g + 8)
};

// Where chunk c of token row `row` lives. The 8 lanes of a quarter-warp read rows 2i, 2i + 1 at chunks
// c(t) for t = 0..3 (same piece index): groups of 128 / 64 take c = 4t + i / 8i' + 2t + i'' (spread by the
// XOR of bit 3 into bit 1, rows apart by bit 0); groups of 32 take c = 4i + t, whose rows must differ in
// bit 2 instead.
template <int GPT>
__device__ __forceinline__ int swz(int c, int row) {
    const int r = (row & 1) * (GPT == 4 ? 4 : 1);
    return (c & 8) | ((c & 7) ^ ((c >> 3) << 1) ^ r);
}

template <int EPI>
__device__ __forceinline__ void store_out(__half* __restrict__ y, const __half* __restrict__ residual, int M,
                                          int N, int m, int n_lo, float lo, float hi) {
    // (m, channel n_lo) and (m, n_lo + 8): rows g and g + 8 of a panel
    if (m >= M) return;
    if (EPI == 2) {
        const int f = (n_lo >> 4) * 8 + (n_lo & 7);
        y[(size_t)m * (N / 2) + f] = __hmul_rn(silu_h(__half2float(__float2half_rn(lo))), __float2half_rn(hi));
    } else {
        const size_t o = (size_t)m * N + n_lo;
        const __half a = __float2half_rn(lo), b = __float2half_rn(hi);
        y[o] = EPI == 1 ? __hadd_rn(a, residual[o]) : a;
        y[o + 8] = EPI == 1 ? __hadd_rn(b, residual[o + 8]) : b;
    }
}

// Warps per block: 4 panels x MH token halves. With MT >= 2 two warps share each panel, one per half of the
// token tiles: the block's 64 channels keep the grid small (q|k|v at 32 tokens: 384 blocks), and 8 warps
// per block instead of 4 hide twice the latency (ncu at 4 warps: 66% of issue slots with no eligible warp).
template <int MT>
__host__ __device__ constexpr int token_halves() { return MT >= 2 ? 2 : 1; }
// Resident blocks the registers are capped for: three of 256 threads (85 registers) hold a q|k|v or gate|up
// grid in one wave; groups of 64 / 32 at 32 tokens need more registers (they spill at 80), so two.
template <int MT, int GPT>
__host__ __device__ constexpr int min_blocks() { return MT == 1 ? 4 : (MT == 4 && GPT > 1) ? 2 : 3; }

template <int MT, int GPT, int EPI>
__device__ __forceinline__ void awq_batch(__half* __restrict__ y, const __half* __restrict__ x,
                                          const uint32_t* __restrict__ packed, const uint32_t* __restrict__ terms,
                                          const __half* __restrict__ residual, float* __restrict__ partial,
                                          int* __restrict__ counters, int M, int N, int K, int tiles, int tps) {
    constexpr int UPG = 4 / GPT;  // 16-byte activation pieces per group run
    constexpr int GS = TILE_K / GPT;
    constexpr int ROWS = MT * 8;
    constexpr int MH = token_halves<MT>();
    constexpr int MW = MT / MH;  // token tiles per warp
    constexpr int THREADS = 128 * MH;
    constexpr int XC = ROWS * CHUNKS / THREADS;  // activation chunks each thread copies per stage
    constexpr int WC = WARPS * 64 / THREADS;     // weight chunks each thread copies per stage
    using St = Stage<MT, GPT>;
    extern __shared__ __align__(16) unsigned char smem[];
    St* st = reinterpret_cast<St*>(smem);
    __shared__ int s_last;

    const int tid = threadIdx.x, lane = tid & 31, p = (tid >> 5) % WARPS, half = (tid >> 5) / WARPS;
    const int g = lane >> 2, t = lane & 3;
    const int panel0 = blockIdx.x * WARPS;
    const int split = blockIdx.y, splits = gridDim.y;
    const int m0 = blockIdx.z * ROWS;
    const int t0 = split * tps, n_t = min(tiles, t0 + tps) - t0;

    // This thread's share of every stage, addressed once: sources at tile t0 (+ kt - t0 tiles per stage).
    const __half* xs[XC];
    int xdst[XC], xk[XC];
    bool xm[XC];
#pragma unroll
    for (int j = 0; j < XC; ++j) {
        const int idx = tid + j * THREADS, row = idx / CHUNKS, c = idx % CHUNKS;
        xm[j] = m0 + row < M;
        xk[j] = t0 * TILE_K + c * 8;
        xs[j] = x + (size_t)(xm[j] ? m0 + row : 0) * K + xk[j];
        xdst[j] = row * CHUNKS + swz<GPT>(c, row);
    }
    const uint32_t* ws[WC];
#pragma unroll
    for (int j = 0; j < WC; ++j) {
        const int idx = tid + j * THREADS, pp = idx >> 6, o = idx & 63;
        ws[j] = packed + ((size_t)(panel0 + pp) * tiles + t0) * TILE_WORDS + o * 4;
    }
    const bool copies_terms = tid < 16 * GPT;  // 4 panels x GPT * 4 chunks
    const uint32_t* ts = terms + ((size_t)(panel0 + tid / (4 * GPT)) * tiles * GPT + (size_t)t0 * GPT) * 16 +
                         (tid % (4 * GPT)) * 4;

    // Stage i (tile t0 + i) into s. A chunk is all inside K or all outside (K % 8 == 0); outside reads zeros.
    auto copy_stage = [&](St& s, int i) {
#pragma unroll
        for (int j = 0; j < XC; ++j) {
            const bool ok = xm[j] && xk[j] + i * TILE_K < K;
            cp_async16(&s.x[0][0] + xdst[j], ok ? xs[j] + i * TILE_K : x, ok);
        }
#pragma unroll
        for (int j = 0; j < WC; ++j) cp_async16(&s.w[0][0] + (tid + j * THREADS), ws[j] + i * TILE_WORDS, true);
        if (copies_terms) cp_async16(reinterpret_cast<uint4*>(&s.tm[0][0][0]) + tid, ts + i * GPT * 16, true);
    };

    float acc[MW][4];
#pragma unroll
    for (int mt = 0; mt < MW; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0.0f;

    auto compute = [&](const St& s) {
        const uint4 w[2] = {s.w[p][lane], s.w[p][32 + lane]};
#pragma unroll
        for (int q = 0; q < GPT; ++q) {
            const AwqTerms tm = awq_terms(s.tm[p][q][g]);
            float tmp[MW][4];
#pragma unroll
            for (int mt = 0; mt < MW; ++mt)
#pragma unroll
                for (int r = 0; r < 4; ++r) tmp[mt][r] = 0.0f;
#pragma unroll
            for (int ii = 0; ii < UPG; ++ii) {
                const int i = q * UPG + ii;                       // the lane's 16-byte piece: mma 2i, 2i + 1
                const int c = q * (GS / 8) + t * (GS / 32) + ii;  // its chunk of the token row
                uint4 xv[MW];
#pragma unroll
                for (int mt = 0; mt < MW; ++mt) xv[mt] = s.x[(half * MW + mt) * 8 + g][swz<GPT>(c, g)];
#pragma unroll
                for (int d = 0; d < 2; ++d) {
                    uint32_t a[4];
                    awq_a_frag(w, 2 * i + d, tm, a);
#pragma unroll
                    for (int mt = 0; mt < MW; ++mt)
                        mma_f16_16816(tmp[mt], a[0], a[1], a[2], a[3], word(xv[mt], 2 * d), word(xv[mt], 2 * d + 1));
                }
            }
            awq_scale_add(acc, tmp, tm);
        }
    };

    pdl_wait();
    pdl_gemv_started(M);
    // Ring of STAGES tiles: tile i in slot i % STAGES, STAGES - 1 tiles in flight ahead of the math. Every
    // iteration commits one group (empty past the end) so that wait_group counts tiles.
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < n_t) copy_stage(st[i], i);
        cp_async_commit();
    }
    for (int i = 0; i < n_t; ++i) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile i have landed
        __syncthreads();              // everyone's have; and every warp is done with slot (i - 1) % STAGES
        const int nx = i + STAGES - 1;
        if (nx < n_t) copy_stage(st[nx % STAGES], nx);
        cp_async_commit();
        compute(st[i % STAGES]);
    }
    pdl_gemv_streamed();

    // c0, c1: channel row g, tokens 2t, 2t + 1 of the warp's tile mt; c2, c3: row g + 8
    const int n_lo = (panel0 + p) * 16 + g;
    const int mw0 = m0 + half * MW * 8 + 2 * t;
    if (splits == 1) {
#pragma unroll
        for (int mt = 0; mt < MW; ++mt) {
            store_out<EPI>(y, residual, M, N, mw0 + mt * 8, n_lo, acc[mt][0], acc[mt][2]);
            store_out<EPI>(y, residual, M, N, mw0 + mt * 8 + 1, n_lo, acc[mt][1], acc[mt][3]);
        }
        return;
    }
    // partial [splits, M, N] fp32
#pragma unroll
    for (int mt = 0; mt < MW; ++mt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int m = mw0 + mt * 8 + e;
            if (m < M) {
                float* row = partial + ((size_t)split * M + m) * N + n_lo;
                row[0] = acc[mt][e];
                row[8] = acc[mt][2 + e];
            }
        }
    }
    if (!last_block_arrives(&counters[blockIdx.z * gridDim.x + blockIdx.x], splits, s_last)) return;
    // (token row, panel, g) entries of the block's tile, each the pair of channels g and g + 8
    for (int e = tid; e < ROWS * WARPS * 8; e += THREADS) {
        const int row = e / (WARPS * 8), pg = e % (WARPS * 8);
        const int m = m0 + row, n = (panel0 + pg / 8) * 16 + pg % 8;
        if (m >= M) continue;
        float lo = 0.0f, hi = 0.0f;
        for (int sp = 0; sp < splits; ++sp) {
            const float* r = partial + ((size_t)sp * M + m) * N + n;
            lo += __ldcg(r);
            hi += __ldcg(r + 8);
        }
        store_out<EPI>(y, residual, M, N, m, n, lo, hi);
    }
}

}  // namespace

// (y fp16, x fp16 [M,K], packed u32 [N/16, tiles, 256], terms u32 [N/16, tiles * GPT, 8, 2], residual fp16
//  [M,N] or null, partial fp32 [splits, M, N] (unused with one split), counters int32 [N/64 * m blocks],
//  int M, int N, int K, int tiles, int tiles_per_split)
#define FLLAMA_AWQ_BATCH(MT, GPT, EPI, NAME)                                                                  \
    extern "C" __global__ void __launch_bounds__(128 * token_halves<MT>(), min_blocks<MT, GPT>())       \
        awq_batch_mt##MT##_g##GPT##_##NAME(__half* y, const __half* x, const uint32_t* packed,               \
                                           const uint32_t* terms, const __half* residual, float* partial,    \
                                           int* counters, int M, int N, int K, int tiles, int tps) {         \
        awq_batch<MT, GPT, EPI>(y, x, packed, terms, residual, partial, counters, M, N, K, tiles, tps);      \
    }
#define FLLAMA_AWQ_BATCH_EPIS(MT, GPT) \
    FLLAMA_AWQ_BATCH(MT, GPT, 0, plain) FLLAMA_AWQ_BATCH(MT, GPT, 1, res) FLLAMA_AWQ_BATCH(MT, GPT, 2, silu)
#define FLLAMA_AWQ_BATCH_GROUPS(MT) FLLAMA_AWQ_BATCH_EPIS(MT, 1) FLLAMA_AWQ_BATCH_EPIS(MT, 2) FLLAMA_AWQ_BATCH_EPIS(MT, 4)
FLLAMA_AWQ_BATCH_GROUPS(1)
FLLAMA_AWQ_BATCH_GROUPS(2)
FLLAMA_AWQ_BATCH_GROUPS(4)
