// The AWQ decode GEMV's body, one 16-channel panel per call (awq_gemv.cu's layout and design notes): used once
// per block by awq_gemv.cu's entries, and in a loop over panels and phases by the persistent chain
// (awq_chain.cu). What differs between the two is kept outside the body:
//   - the panel's first step of weights and terms (AwqStep) is loaded by the caller, before whatever the
//     activations wait for (the PDL wait, or the chain's grid barrier);
//   - `after_loop(step)` runs right after the main loop: the entries trigger the next kernel there
//     (pdl_gemv_streamed), the chain loads the first step of its next panel into `step`, whose registers are
//     free by then, so that panel's weights are in flight through this one's reduction and epilogue;
//   - COHERENT: activations, the residual and the norm's sums through plain (coherent) loads, because in the
//     chain other blocks wrote them earlier in the same kernel; the entries keep the non-coherent path.
#pragma once
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "norm_fold.cuh"

namespace fllama {
namespace awq {

constexpr int TILE_K = 128;
constexpr int TILE_WORDS = 256;  // 1 KB: 2 rows x 32 lanes x 4 words

// One step of a warp: U tiles of weights (rows g and g + 8) and their group terms.
template <int U, int GPT>
struct Step {
    uint4 w[U][2];
    uint2 tm[U][GPT];
};

// Full steps of U tiles per warp for W warps that lie wholly inside K (all but at most the last).
template <int U, int W>
__device__ __forceinline__ int full_steps(int K) {
    return K / (U * W * TILE_K);
}

// This warp's first weight words / terms of `panel`: tile `warp`; every load of a step is base + immediate.
template <int GPT>
__device__ __forceinline__ const uint32_t* first_words(const uint32_t* packed, int panel, int tiles) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return packed + ((size_t)panel * tiles + warp) * TILE_WORDS + lane * 4;
}
template <int GPT>
__device__ __forceinline__ const uint32_t* first_terms(const uint32_t* terms, int panel, int tiles) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return terms + ((size_t)panel * tiles * GPT * 8 + (lane >> 2)) * 2 + warp * GPT * 16;
}

// A step's weights and terms (tiles base + u W + warp). The last step (`last`, a constant at every call site
// but the first) reads tiles past the end as zeros; the others load unguarded, as base + immediates.
template <int U, int W, int GPT>
__device__ __forceinline__ void load_step(bool last, int base, int tiles, const uint32_t* w, const uint32_t* tm,
                                          Step<U, GPT>& s) {
    const int warp = threadIdx.x >> 5;
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
}

// The first step of `panel` (weights only: nothing the previous kernel or phase writes).
template <int U, int W, int GPT>
__device__ __forceinline__ void load_first(const uint32_t* packed, const uint32_t* terms, int panel, int K, int tiles,
                                           Step<U, GPT>& s) {
    load_step<U, W, GPT>(full_steps<U, W>(K) == 0, 0, tiles, first_words<GPT>(packed, panel, tiles),
                         first_terms<GPT>(terms, panel, tiles), s);
}

// y[m0.., panel's 16 channels] for up to 8 MT tokens from m0. `sa` holds the panel's first step (load_first);
// rstd: a consumer of the deferred norm computes its tokens' rstd (once per block: the chain's later panels of
// the same phase reuse s_rstd). Every thread of the block calls it, and every thread returns.
template <int MT, int GPT, int EPI, int U, int W, bool COHERENT, typename AfterLoop>
__device__ __forceinline__ void gemv_panel(__half* __restrict__ y, const __half* __restrict__ x,
                                           const uint32_t* __restrict__ packed, const uint32_t* __restrict__ terms,
                                           const __half* __restrict__ residual, int M, int N, int K, int tiles,
                                           const __half* __restrict__ fold_w, __half* __restrict__ fold_xg,
                                           float* __restrict__ fold_part, const float* __restrict__ fold_in,
                                           float eps, int panel, int m0, Step<U, GPT>& sa, bool rstd,
                                           AfterLoop after_loop) {
    constexpr int MPG = 8 / GPT;  // mma per group
    constexpr int UPG = 4 / GPT;  // 16-byte activation loads per group-run
    constexpr int GS = TILE_K / GPT;
    static_assert(GPT == 1 || GPT == 2 || GPT == 4, "groups of 128, 64 or 32 k per tile run");
    __shared__ float red[W][MT][4][32];
    __shared__ float s_rstd[8 * MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int rows = min(M - m0, 8 * MT);
    // the deferred norm is compiled where the registers allow it, MT * GPT <= 4 (8 tokens and any group size, 16
    // with groups of 64 or 128 k, 32 with 128); the others are at their budget without it (awq_gemv.py: folds)
    constexpr bool FOLD = MT * GPT <= 4;
    if (!FOLD) fold_w = nullptr, fold_in = nullptr;

    bool x_ok[MT];
    const __half* x_row[MT];
    token_rows<MT>(x, M, K, m0, g, t * (GS / 4), x_ok, x_row);
    const uint32_t* wq = first_words<GPT>(packed, panel, tiles);
    const uint32_t* tq = first_terms<GPT>(terms, panel, tiles);
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
    // At M <= 8 the kernel is bound by instruction issue (ncu: docs/gpu.md), so the steps that lie wholly
    // inside K (all but at most the last) run without guards, zero fills or per-load address arithmetic;
    // only the last step (tiles past the end, k's past K) is guarded.
    constexpr int STEP = U * W;
    const int full = full_steps<U, W>(K);
    auto compute = [&](const Step<U, GPT>& c, const uint4 (&xv)[U][MT][4]) {
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
                        xv[u][mt][i] = ld_act_always<COHERENT>(p);
                    } else {
                        const int k = (full * STEP + u * W + warp) * TILE_K + t * (GS / 4) + x_off(i);
                        xv[u][mt][i] = ld_act<COHERENT>(p, k < K && x_ok[mt]);
                    }
                }
    };
    // One full step: the next step's weights and terms (full or the guarded last one), this step's
    // activations, its math.
    auto full_step = [&](int s, const Step<U, GPT>& c, Step<U, GPT>& n) {
        if (s + 1 < full) load_step<U, W, GPT>(false, (s + 1) * STEP, tiles, wq + STEP * TILE_WORDS, tq + STEP * GPT * 16, n);
        else load_step<U, W, GPT>(true, (s + 1) * STEP, tiles, wq + STEP * TILE_WORDS, tq + STEP * GPT * 16, n);
        uint4 xv[U][MT][4];
        load_x(false, xv);
        compute(c, xv);
        wq += STEP * TILE_WORDS;
        tq += STEP * GPT * 16;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) xq[mt] += STEP * TILE_K;
    };
    auto last_step = [&](const Step<U, GPT>& c) {
        uint4 xv[U][MT][4];
        load_x(true, xv);
        compute(c, xv);
    };

    // the producer's norm weight (channels g and g + 8 of the panel), used in the epilogue
    __half2 nw = __float2half2_rn(0.0f);
    if (EPI == 1 && fold_w != nullptr) nw = __halves2half2(fold_w[panel * 16 + g], fold_w[panel * 16 + g + 8]);
    if (fold_in != nullptr && rstd) fold_prefetch<W>(fold_in, m0, rows, K / 16);  // L1 by the tail

    // Two step buffers used in turn (copying one into the other would cost 40 moves per step).
    Step<U, GPT> sb;
    int s = 0;
    for (; s + 1 < full; s += 2) {
        full_step(s, sa, sb);
        full_step(s + 1, sb, sa);
    }
    const bool in_b = s < full;  // an odd number of full steps: one more, and the last one lands in sb
    if (in_b) full_step(s, sa, sb);
    if (full * STEP < tiles) {
        if (in_b) last_step(sb);
        else last_step(sa);
    }

    after_loop(sa);
    // the deferred norm: each warp's rstd (its 8 MT / W tokens), read by all after the barrier below
    if (fold_in != nullptr && rstd) fold_rstd<W, 8 * MT / W, COHERENT>(s_rstd, fold_in, m0, rows, K / 16, K, eps);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = acc[mt][r];
    __syncthreads();  // red, and the deferred norm's s_rstd

    // Thread (r, l) sums accumulator r of lane l over the warps in a fixed order (deterministic): warps 0-3.
    if (W > 4 && warp >= 4) return;
    const int r = warp, l = lane;
    auto red_sum = [&](int mt, int rr) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) sum += red[w][mt][rr][l];
        return sum;
    };
    if (EPI == 1 && fold_w != nullptr) {  // producer: a thread takes rows r and r + 2 (channels g, g + 8) of a token
        if (r >= 2) return;                // warp-uniform
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            fold_store<COHERENT>(y, fold_xg, fold_part, residual, nw, red_sum(mt, r), red_sum(mt, r + 2),
                                 m0 + mt * 8 + 2 * (l & 3) + (r & 1), M, N, panel * 16 + (l >> 2), panel);
        return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
        if (m >= M) continue;
        const float rs = fold_in != nullptr ? s_rstd[m - m0] : 1.0f;
        auto total = [&](int rr) { return fold_in != nullptr ? red_sum(mt, rr) * rs : red_sum(mt, rr); };
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
            y[o] = EPI == 1 ? __hadd_rn(h, ld_act_h<COHERENT>(residual + o)) : h;
        }
    }
}

}  // namespace awq
}  // namespace fllama
