// AWQ W4A16 decode GEMV on the engine's own int4 layout (awq_gemv.py repacks AutoAWQ's GEMM tensors once,
// at load): y[m, n] = sum over groups of s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[m, k].
//
// Why another layout: in AutoAWQ's [K, N/8] words a lane's 16-byte load holds 4 rows x 8 columns, which
// must be transposed (prmt) and scaled per pair before an mma can use it; the kernel that reads it
// directly (awq_gemm.cu) is instruction-bound at ~40-50% of the bandwidth. Here every lane's 16 bytes
// are already 32 k-values of ONE output channel, nibbles placed so that the four LOP3 extractions of a
// word give A-fragment pairs of an m16n8k16 mma as they come:
//   block = W = 4 (or 16 / 8 / 2 / 1, the *_w16 / *_w8 / *_w2 / *_w1 entries) warps on a panel of 16 output
//   channels (rows g and g + 8 of the mma, as fp16_gemv.cu), the warps taking turns over the panel's 128-k tiles and
//   meeting in shared memory at the end (warps 0-3 sum and write; with 2 warps each thread two of the four sums,
//   with 1 all four);
//   a 128-k tile of the panel is 1 KB: [h = row g | row g + 8][lane][4 words];
//   lane (g, t)'s 32 values of a tile are, for each group q of the tile (GS = 128 / GPT k's), the GS / 4
//   consecutive k's k0 + q * GS + t * GS / 4 ...: its activations are 64 contiguous bytes per group-run,
//   i.e. four 16-byte loads, and every mma (16 k's) lies inside one group.
//   word w feeds mma 2w and 2w + 1: nibbles (0, 4) -> a0 of mma 2w, (1, 5) -> a2, and after >> 8 the
//   same for mma 2w + 1 (the positions 0..7 of the word's 8 values sit in nibbles [0, 4, 1, 5, 2, 6, 3, 7]).
// q - z is made exact in fp16 by the magic-number subtraction (no scale there); each group's mma sum is
// then scaled by s in fp32. That is one fp16 op per weight pair fewer than w_hat = (q - z) * s, and it
// skips w_hat's fp16 rounding (so the result is nearer the exact product than the reference's w_hat).
// Per (channel, group of GS k's) one uint32 of terms: fp16 s (low half), fp16 1024 + z (high half).
//
// EPI 0: y fp16 [M, N];  1: + residual (fp16 add after rounding);  2: SwiGLU of a gate|up panel
// interleaved by 8 (rows 0-7 gate channels 8b.., rows 8-15 the same up channels): y [M, N / 2] =
// fp16(silu(fp16 gate)) * fp16 up, silu_mul.cu's rounding.
// The deferred RMSNorm (norm_fold.cuh), chosen at run time by non-null pointers: fold_w (EPI 1 only) makes
// this GEMV a producer (also xg = fp16(h * fold_w) and the panel's sum of h^2); fold_in a consumer (x is xg,
// each token's sums scaled by its rstd before rounding).
// res_early (EPI 1, one token tile): the residual is read before the PDL wait (its writer is two kernels back).
// Entry points awq_gemv_mt{MT}_g{GPT}_{plain|res|silu}(y, x, packed, terms, residual, M, N, K, tiles, fold_w,
//   fold_xg, fold_part, fold_in, eps, res_early), grid (N / 16, ceil(M / (8 * MT))), block 128;
//   awq_gemv_mt1_g1_*_w16 / *_w8 / *_w2 / *_w1 the same with block 512 / 256 / 64 / 32.
// awq_packed_dequant: w_hat [N, K] fp16 = fp16((q - z) * s) from the same layout (prefill, then cuBLAS).
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "norm_fold.cuh"

using namespace fllama;

namespace {

constexpr int TILE_K = 128;
constexpr int TILE_WORDS = 256;  // 1 KB: 2 rows x 32 lanes x 4 words

template <int MT, int GPT, int EPI, int U, int W>
__device__ __forceinline__ void awq_gemv(__half* __restrict__ y, const __half* __restrict__ x,
                                         const uint32_t* __restrict__ packed, const uint32_t* __restrict__ terms,
                                         const __half* __restrict__ residual, int M, int N, int K, int tiles,
                                         const __half* __restrict__ fold_w, __half* __restrict__ fold_xg,
                                         float* __restrict__ fold_part, const float* __restrict__ fold_in,
                                         float eps, int res_early) {
    constexpr int MPG = 8 / GPT;  // mma per group
    constexpr int UPG = 4 / GPT;  // 16-byte activation loads per group-run
    constexpr int GS = TILE_K / GPT;
    static_assert(GPT == 1 || GPT == 2 || GPT == 4, "groups of 128, 64 or 32 k per tile run");
    __shared__ float red[W][MT][4][32];
    __shared__ float s_rstd[8 * MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int panel = blockIdx.x;
    const int m0 = blockIdx.y * 8 * MT;
    const int rows = min(M - m0, 8 * MT);
    // the deferred norm is compiled where the registers allow it, MT * GPT <= 4 (8 tokens and any group size, 16
    // with groups of 64 or 128 k, 32 with 128); the others are at their budget without it (awq_gemv.py: folds)
    constexpr bool FOLD = MT * GPT <= 4;
    if (!FOLD) fold_w = nullptr, fold_in = nullptr;

    bool x_ok[MT];
    const __half* x_row[MT];
    token_rows<MT>(x, M, K, m0, g, t * (GS / 4), x_ok, x_row);
    // This warp's first tile (tile `warp` of the panel): every load of a step is step base + immediate.
    const uint32_t* wq = packed + ((size_t)panel * tiles + warp) * TILE_WORDS + lane * 4;
    const uint32_t* tq = terms + ((size_t)panel * tiles * GPT * 8 + g) * 2 + warp * GPT * 16;
    const __half* xq[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xq[mt] = x_row[mt] + warp * TILE_K;

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0.0f;

    // One step = U tiles of this warp (tile = base + u * W + warp). The weights and group terms of the
    // next step are issued before this step's math (software pipeline, as in fp16_gemv.cu), so a warp
    // keeps U KB of weights in flight; activations (L1/L2 hits after the first warp) are loaded at the
    // start of their step, which keeps the registers within what the entry points' block counts allow.
    // At M <= 8 the kernel is bound by instruction issue, so the steps that lie wholly
    // inside K (all but at most the last) run without guards, zero fills or per-load address arithmetic;
    // only the last step (tiles past the end, k's past K) is guarded.
    constexpr int STEP = U * W;
    const int full_steps = K / (STEP * TILE_K);
    struct Step {
        uint4 w[U][2];
        uint2 tm[U][GPT];
    };
    // A step's weights and terms into s. The last step (`last`, a constant at every call site) reads tiles
    // past the end as zeros; the others load unguarded, as base + immediates.
    auto load_w = [&](bool last, int base, const uint32_t* w, const uint32_t* tm, Step& s) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t* wu = w + u * W * TILE_WORDS;
            const uint32_t* tu = tm + u * W * GPT * 16;
            const bool ok = base + u * W + warp < tiles;
            s.w[u][0] = last ? ld_stream(wu, ok) : ld_stream_always(wu);
            s.w[u][1] = last ? ld_stream(wu + 128, ok) : ld_stream_always(wu + 128);
#pragma unroll
            for (int q = 0; q < GPT; ++q) s.tm[u][q] = last ? ld_cached8(tu + q * 16, ok) : ld_cached8_always(tu + q * 16);
        }
    };
    auto compute = [&](const Step& c, const uint4 (&xv)[U][MT][4]) {
#ifdef FLLAMA_AWQ_TIMING_NO_MATH
        // Timing probe only (wrong results): every load of the kernel as it is, consumed, without the math: the
        // ceiling of this load pattern and grid.
        uint32_t v = 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            v ^= c.w[u][0].x ^ c.w[u][0].y ^ c.w[u][0].z ^ c.w[u][0].w ^ c.w[u][1].x ^ c.w[u][1].y ^ c.w[u][1].z ^
                 c.w[u][1].w ^ c.tm[u][0].x ^ c.tm[u][0].y;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) v ^= xv[u][mt][i].x ^ xv[u][mt][i].w;
        }
        acc[0][0] += (float)(v & 1);
#else
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int q = 0; q < GPT; ++q) {
                const AwqTerms tm = awq_terms(c.tm[u][q]);
                float tmp[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) tmp[mt][r] = 0.0f;
#pragma unroll
                for (int jj = 0; jj < MPG; ++jj) {
                    const int j = q * MPG + jj;  // mma index in the tile: word j / 2, half (j % 2) of it
                    uint32_t a[4];
                    awq_a_frag(c.w[u], j, tm, a);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const uint4& xw = xv[u][mt][j >> 1];
                        mma_f16_16816(tmp[mt], a[0], a[1], a[2], a[3], word(xw, 2 * (j & 1)), word(xw, 2 * (j & 1) + 1));
                    }
                }
                awq_scale_add(acc, tmp, tm);
            }
        }
#endif
    };
    // x offset of load i of a tile (from the lane's run start): group run i / UPG, 16-byte piece i % UPG
    auto x_off = [](int i) { return (i / UPG) * GS + (i % UPG) * 8; };

    // A step's activations (L1/L2 hits after the first warp). Full steps: rows past M read row 0 (token_rows),
    // which only feeds mma columns nobody writes out. The last step: k's past K read as zeros (their weights
    // are zero padding). `last` is a constant at both call sites.
    auto load_x = [&](bool last, uint4 (&xv)[U][MT][4]) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const __half* p = xq[mt] + u * W * TILE_K + x_off(i);
                    if (!last) {
                        xv[u][mt][i] = ld_cached_always(p);
                    } else {
                        const int k = (full_steps * STEP + u * W + warp) * TILE_K + t * (GS / 4) + x_off(i);
                        xv[u][mt][i] = ld_cached(p, k < K && x_ok[mt]);
                    }
                }
    };
    // One full step: the next step's weights and terms (full or the guarded last one), this step's
    // activations, its math.
    auto full_step = [&](int s, const Step& c, Step& n) {
        if (s + 1 < full_steps) load_w(false, (s + 1) * STEP, wq + STEP * TILE_WORDS, tq + STEP * GPT * 16, n);
        else load_w(true, (s + 1) * STEP, wq + STEP * TILE_WORDS, tq + STEP * GPT * 16, n);
        uint4 xv[U][MT][4];
        load_x(false, xv);
        compute(c, xv);
        wq += STEP * TILE_WORDS;
        tq += STEP * GPT * 16;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xq[mt] += STEP * TILE_K;
    };
    auto last_step = [&](const Step& c) {
        uint4 xv[U][MT][4];
        load_x(true, xv);
        compute(c, xv);
    };

    // Two step buffers used in turn (copying one into the other would cost 40 moves per step).
    Step sa, sb;
    // weights and terms do not depend on the previous kernel: in flight before the wait (as the producer's norm
    // weight, channels g and g + 8 of the panel)
    __half2 nw = __float2half2_rn(0.0f);  // (channel g, channel g + 8)
    if (EPI == 1 && fold_w != nullptr) nw = __halves2half2(fold_w[panel * 16 + g], fold_w[panel * 16 + g + 8]);
    if (full_steps > 0) load_w(false, 0, wq, tq, sa);
    else load_w(true, 0, wq, tq, sa);
    // The residual this thread adds in its epilogue rows (r = warp + i RSTEP, i < RPT), read before the wait where
    // the caller says its writer had completed before the kernel ahead of this one passed its wait (res_early): the
    // tail then waits for no L2 round trip. One token tile only: the wider entries are at their register budget.
    constexpr int RSTEP = W < 4 ? W : 4, RPT = W >= 4 ? 1 : 4 / W;
    const bool early = EPI == 1 && MT == 1 && res_early != 0;
    __half2 rp[RPT][MT];
    if (early) {
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = warp + i * RSTEP;
                rp[i][mt] = residual_ahead(residual, fold_w != nullptr, r, m0 + mt * 8 + 2 * (lane & 3) + (r & 1), M,
                                           N, panel * 16 + (lane >> 2));
            }
    }
    pdl_wait();
    pdl_gemv_started(M);
    if (fold_in != nullptr) fold_prefetch<W>(fold_in, m0, rows, K / 16);  // L1 by the tail
    int s = 0;
    for (; s + 1 < full_steps; s += 2) {
        full_step(s, sa, sb);
        full_step(s + 1, sb, sa);
    }
    const bool in_b = s < full_steps;  // an odd number of full steps: one more, and the last one lands in sb
    if (in_b) full_step(s, sa, sb);
    if (full_steps * STEP < tiles) {
        if (in_b) last_step(sb);
        else last_step(sa);
    }

    pdl_gemv_streamed();
    // the deferred norm: each warp's rstd (its 8 MT / W tokens), read by all after the barrier below
    if (fold_in != nullptr) fold_rstd<W, (8 * MT + W - 1) / W>(s_rstd, fold_in, m0, rows, K / 16, K, eps);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = acc[mt][r];
    __syncthreads();  // red, and the deferred norm's s_rstd

    // Thread (r, l) sums accumulator r of lane l over the warps in a fixed order (deterministic): warps 0-3; with
    // fewer warps each thread takes r = warp, warp + W, ... in turn.
    if (W > 4 && warp >= 4) return;
    const int l = lane;
    auto red_sum = [&](int mt, int rr) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) sum += red[w][mt][rr][l];
        return sum;
    };
    auto epilogue = [&](int r, int i) {
        if (EPI == 1 && fold_w != nullptr) {  // producer: rows r and r + 2 (channels g, g + 8) of a token
            if (r >= 2) return;                // warp-uniform
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (early)
                    fold_store_res(y, fold_xg, fold_part, rp[i][mt], nw, red_sum(mt, r), red_sum(mt, r + 2),
                                   m0 + mt * 8 + 2 * (l & 3) + (r & 1), M, N, panel * 16 + (l >> 2), panel);
                else
                    fold_store(y, fold_xg, fold_part, residual, nw, red_sum(mt, r), red_sum(mt, r + 2),
                               m0 + mt * 8 + 2 * (l & 3) + (r & 1), M, N, panel * 16 + (l >> 2), panel);
            }
            return;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
            if (m >= M) continue;
            const float rstd = fold_in != nullptr ? s_rstd[m - m0] : 1.0f;
            auto total = [&](int rr) { return fold_in != nullptr ? red_sum(mt, rr) * rstd : red_sum(mt, rr); };
            if (EPI == 2) {  // rows g (r 0, 1) are gate channels, rows g + 8 (r 2, 3) the matching up channels
                if (r < 2) {
                    const int f = panel * 8 + (l >> 2);
                    const __half gate = __float2half_rn(total(r)), up = __float2half_rn(total(r + 2));
                    y[(size_t)m * (N / 2) + f] = __hmul_rn(silu_h(__half2float(gate)), up);
                }
            } else {
                const int n = panel * 16 + (l >> 2) + (r >= 2 ? 8 : 0);
                const size_t o = (size_t)m * N + n;
                const __half h = __float2half_rn(total(r));
                y[o] = EPI == 1 ? __hadd_rn(h, early ? __low2half(rp[i][mt]) : residual[o]) : h;
            }
        }
    };
#pragma unroll
    for (int i = 0; i < RPT; ++i)
        if (warp + i * RSTEP < 4) epilogue(warp + i * RSTEP, i);
}

// w_hat [N, K] = fp16((q - z) * s): one thread per 16 bytes of w_hat (8 consecutive k of one channel, which
// are the 8 nibbles of one packed word), threads ordered (channel, tile, chunk c of the tile) so that a warp
// stores 512 contiguous bytes of a w_hat row with each instruction (a thread per lane's 16-byte chunk would
// store 64 bytes apart: half-sector writes). The reads (one word per thread, 64 contiguous bytes per 16
// threads) are a fifth of the bytes. Bit-identical to model_zoo.quant.awq_pack.dequantize_awq.
template <int GPT>
__device__ __forceinline__ void awq_packed_dequant(__half* __restrict__ w_hat, const uint32_t* __restrict__ packed,
                                                   const uint32_t* __restrict__ terms, int N, int K, int tiles) {
    constexpr int GS = TILE_K / GPT;  // k's of one group-run
    constexpr int MPG = 8 / GPT;      // a lane's runs of 4 k per group-run (two per packed word)
    pdl_enter();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * tiles * 16) return;
    const int c = (int)(i & 15);  // w_hat k = tile * 128 + 8 c .. + 7
    const size_t rest = i >> 4;
    const int tile = (int)(rest % tiles), n = (int)(rest / tiles);
    const int k = tile * TILE_K + 8 * c;
    if (k >= K) return;  // K % 8 == 0: the 8 values are all in or all out (padding dropped)
    // Where k sits in the layout: group-run q, lane t's run of GS / 4 k's, the mma-run pair jj (even) in it,
    // hence packed word w = (q * MPG + jj) / 2 of lane (g, t) (_k_order in awq_gemv.py).
    const int q = (8 * c) / GS, r = (8 * c) % GS;
    const int t = r / (GS / 4), jj = (r % (GS / 4)) / 4;
    const int w = (q * MPG + jj) >> 1;
    const int panel = n >> 4, h = (n >> 3) & 1, g = n & 7;
    const size_t pt = (size_t)panel * tiles + tile;
    const uint32_t wd = packed[((pt * 2 + h) * 32 + g * 4 + t) * 4 + w];
    const uint32_t v = terms[((pt * GPT + q) * 8 + g) * 2 + h];
    *reinterpret_cast<uint4*>(w_hat + (size_t)n * K + k) = awq_w_hat8(wd, v);
}

}  // namespace

// (y fp16, x fp16 [M,K], packed u32 [N/16, tiles, 256], terms u32 [N/16, tiles * GPT, 8, 2],
//  residual fp16 [M,N] or null, int M, int N, int K, int tiles, fold_w fp16 [N] or null, fold_xg fp16 [M,N],
//  fold_part f32 [M,N/16], fold_in f32 [M,K/16] or null, float eps, int res_early)
#define FLLAMA_AWQ_GEMV_W(MT, GPT, EPI, U, W, BLOCKS, NAME)                                                \
    extern "C" __global__ void __launch_bounds__(32 * W, BLOCKS) awq_gemv_mt##MT##_g##GPT##_##NAME(        \
        __half* y, const __half* x, const uint32_t* packed, const uint32_t* terms, const __half* residual,  \
        int M, int N, int K, int tiles, const __half* fold_w, __half* fold_xg, float* fold_part,            \
        const float* fold_in, float eps, int res_early) {                                                   \
        awq_gemv<MT, GPT, EPI, U, W>(y, x, packed, terms, residual, M, N, K, tiles, fold_w, fold_xg,        \
                                     fold_part, fold_in, eps, res_early);                                   \
    }
#define FLLAMA_AWQ_GEMV(MT, GPT, EPI, U, BLOCKS, NAME) FLLAMA_AWQ_GEMV_W(MT, GPT, EPI, U, 4, BLOCKS, NAME)
#define FLLAMA_AWQ_GEMV_EPIS(MT, GPT, U, BLOCKS)                                                 \
    FLLAMA_AWQ_GEMV(MT, GPT, 0, U, BLOCKS, plain) FLLAMA_AWQ_GEMV(MT, GPT, 1, U, BLOCKS, res) \
    FLLAMA_AWQ_GEMV(MT, GPT, 2, U, BLOCKS, silu)
#define FLLAMA_AWQ_GEMV_GROUPS(MT, U) \
    FLLAMA_AWQ_GEMV_EPIS(MT, 1, U, 3) FLLAMA_AWQ_GEMV_EPIS(MT, 2, U, 3) FLLAMA_AWQ_GEMV_EPIS(MT, 4, U, 3)

// U tiles per step (in flight per warp) against resident blocks per SM (BLOCKS, which caps the registers).
// At 8 tokens and groups of 128: U = 2 in four blocks (114 registers) rather than U = 4 in three (168): the down
// and gate|up GEMVs gain more from the fourth block than q|k|v loses. Groups of 64 / 32 (terms take 4 / 8
// registers per tile): U = 3 / 2 in three blocks (U = 4 spills). 16 / 32 tokens: U = 2 / 1 in three blocks.
FLLAMA_AWQ_GEMV_EPIS(1, 1, 2, 4) FLLAMA_AWQ_GEMV_EPIS(1, 2, 3, 3) FLLAMA_AWQ_GEMV_EPIS(1, 4, 2, 3)
FLLAMA_AWQ_GEMV_GROUPS(2, 2)
FLLAMA_AWQ_GEMV_GROUPS(4, 1)
// W = 8 warps per panel (block 256, two resident: the same 16 warps per SM), 8 tokens, groups of 128, for
// grids of one wave of them (awq_gemv.py gemv_warps): LLaMA-2-7B's o_proj / down_proj have 256 panels, which at
// 4 warps leave every SM about two blocks, half its warp slots; at 8 each warp streams half the tiles.
FLLAMA_AWQ_GEMV_W(1, 1, 0, 2, 8, 2, plain_w8)
FLLAMA_AWQ_GEMV_W(1, 1, 1, 2, 8, 2, res_w8)
FLLAMA_AWQ_GEMV_W(1, 1, 2, 2, 8, 2, silu_w8)
// W = 16 warps per panel (block 512, one resident: its registers fill the SM), 8 tokens, groups of 128, for grids
// of at most one block a SM at one row, K beyond one 8-warp step (gemv_warps: Llama-3.2-1B's down_proj, 128 panels
// of 64 tiles): twice the tiles in flight of the 8-warp entry, so half as many round trips after the PDL wait.
FLLAMA_AWQ_GEMV_W(1, 1, 0, 2, 16, 1, plain_w16)
FLLAMA_AWQ_GEMV_W(1, 1, 1, 2, 16, 1, res_w16)
FLLAMA_AWQ_GEMV_W(1, 1, 2, 2, 16, 1, silu_w16)
// W = 2 warps per panel (block 64, eight resident: the same 16 warps per SM), 8 tokens, groups of 128, for grids
// of one wave of them (gemv_warps: LLaMA-2-7B's q|k|v, 768 panels); the epilogue's threads each write two of a
// lane's four accumulators.
FLLAMA_AWQ_GEMV_W(1, 1, 0, 2, 2, 8, plain_w2)
FLLAMA_AWQ_GEMV_W(1, 1, 1, 2, 2, 8, res_w2)
FLLAMA_AWQ_GEMV_W(1, 1, 2, 2, 2, 8, silu_w2)
// W = 1 warp per panel (block 32, sixteen resident), 8 tokens, groups of 128, for grids of one wave of them at 8
// rows (gemv_warps: LLaMA-2-7B's gate|up, 1376 panels, at batch 5-8); no cross-warp reduction, the warp writes all
// four of a lane's accumulators.
FLLAMA_AWQ_GEMV_W(1, 1, 0, 2, 1, 16, plain_w1)
FLLAMA_AWQ_GEMV_W(1, 1, 1, 2, 1, 16, res_w1)
FLLAMA_AWQ_GEMV_W(1, 1, 2, 2, 1, 16, silu_w1)

// (w_hat fp16 [N,K], packed, terms, int N, int K, int tiles); one thread per 16 bytes of w_hat
#define FLLAMA_AWQ_PACKED_DEQUANT(GPT)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) awq_packed_dequant_g##GPT(                           \
        __half* w_hat, const uint32_t* packed, const uint32_t* terms, int N, int K, int tiles) {           \
        awq_packed_dequant<GPT>(w_hat, packed, terms, N, K, tiles);                                         \
    }
FLLAMA_AWQ_PACKED_DEQUANT(1)
FLLAMA_AWQ_PACKED_DEQUANT(2)
FLLAMA_AWQ_PACKED_DEQUANT(4)
