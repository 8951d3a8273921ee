// fp8_gemv_w2x{4,8}[_res|_silu]: 32 token rows against 32 output channels a block (tuning.fp8_gemv_block_channels).
// fp8_gemm.cu's 32-row GEMV (mt4) gives each block 16 channels, so every block reads all 32 token rows over K from L2
// (twice the bytes of its weights) and converts each 8-token tile's codes once per 16 channels. Here each warp owns
// two 16-channel panels (the warps still split K, so N = 4096 keeps 128 blocks), and each step's 32 token rows are
// copied by cp.async beside its weight rows into the warp's stage of the ring: activations cost as many L2 bytes as
// the weights, each converted activation word serves both panels (cvt per weight byte 1.0 against mt4's 1.5), and no
// loads are in flight in registers, so each warp keeps STAGES - 1 steps (a 128-byte line of every row: two k tiles;
// 24 KB of ring a warp) in flight. WW warps a block: 8 (one block a SM: grids of at most one wave) or 4 (two a SM,
// so that one block's pipeline fill and epilogue run under the other's loads). Weights go in before the PDL wait,
// each stage's activations after it. The mma are Fp8Mma's on the same fragments in the same order, so each warp's
// sums are mt4's where its k's are (8-warp blocks: mt4's bits).
#include "fp8_common.cuh"

using namespace fllama;

namespace {

constexpr int WIDE_MT = 4;  // 32 token rows
constexpr int WIDE_NC = 2;  // 16-channel panels a warp
template <int WW>
struct WideShape {
    static constexpr int STAGES = 3;                                       // fp8_gemm.py wide_ring
    static constexpr int W_ROWS = 16 * WIDE_NC, ROWS = W_ROWS + 8 * WIDE_MT;  // a stage: weight rows, then token rows
    static constexpr int STAGE_BYTES = ROWS * 128;                         // a 128-byte line a row
    static constexpr int RING_BYTES = WW * STAGES * STAGE_BYTES;
    static_assert(WW * WIDE_NC * WIDE_MT * 4 * 32 * 4 <= RING_BYTES, "the epilogue's sums reuse the ring");
};

template <int WW, int EPI>
__device__ __forceinline__ void fp8_gemv_wide(__half* __restrict__ y, const uint8_t* __restrict__ x8,
                                              const float* __restrict__ a_scale, int a_stride,
                                              const uint8_t* __restrict__ w8, const float* __restrict__ w_scale,
                                              const __half* residual, Int8Fold fold, float* part, int M, int N,
                                              int K) {
    using S = WideShape<WW>;
    constexpr int NC = WIDE_NC;
    extern __shared__ __align__(128) uint8_t ring[];
    if (dynamic_smem_size() < S::RING_BYTES) __trap();  // the launcher's shared=
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * 8 * WIDE_MT, n0 = blockIdx.y * 16 * NC;
    const int lines = (K + 127) / 128;  // a warp step: one 128-byte line of every row (two 64-wide k tiles)
    uint8_t* my_ring = ring + warp * S::STAGES * S::STAGE_BYTES;

    // the copies: lane copies chunk lane & 7 of rows 4 i + lane / 8 (weight rows first, then token rows), 512 bytes
    // a warp instruction; chunk c of an odd row lands at c ^ 4 so that rows g, g + 1 of a 16-byte read phase hit
    // different banks
    const int q = lane >> 3, chunk = lane & 7;
    const uint8_t* w_src = w8 + (size_t)(n0 + q) * K + 16 * chunk;
    const uint8_t* x_src = x8 + (size_t)(m0 + q) * K + 16 * chunk;
    const uint32_t dst0 = q * 128 + 16 * (chunk ^ ((q & 1) << 2));  // rows 4 i + q: parity of q
    auto issue_w = [&](int line, int stage) {
        if (line < lines) {
            uint8_t* st = my_ring + stage * S::STAGE_BYTES;
            const bool k_ok = 128 * line + 16 * chunk < K;
#pragma unroll
            for (int i = 0; i < S::W_ROWS / 4; ++i) {
                const bool ok = k_ok && n0 + 4 * i + q < N;
                cp_async16(st + dst0 + 512 * i, ok ? w_src + (size_t)(4 * i) * K + 128 * line : w8, ok);
            }
        }
    };
    auto issue_x = [&](int line, int stage) {
        if (line < lines) {
            uint8_t* st = my_ring + stage * S::STAGE_BYTES + S::W_ROWS * 128;
            const bool k_ok = 128 * line + 16 * chunk < K;
#pragma unroll
            for (int i = 0; i < 2 * WIDE_MT; ++i) {
                const bool ok = k_ok && m0 + 4 * i + q < M;
                cp_async16(st + dst0 + 512 * i, ok ? x_src + (size_t)(4 * i) * K + 128 * line : x8, ok);
            }
        }
    };

    float acc[NC][WIDE_MT][4];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int mt = 0; mt < WIDE_MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[c][mt][r] = 0.0f;

    // commit groups: the first STAGES - 1 steps' weights, then (after the wait) their activations, then one group a
    // step; at step i the groups after step i's are always STAGES - 1
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s) {
        issue_w(warp + s * WW, s);
        cp_async_commit();
    }
    pdl_wait();
    pdl_gemv_started(M);
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s) {
        issue_x(warp + s * WW, s);
        cp_async_commit();
    }
    // the fragments: row r at byte 64 u + 16 t of its line = chunk (4 u + t) ^ (4 (r & 1)); r & 1 = g & 1 for all
    const int frag_off = g * 128;
    const int swz = (g & 1) << 2;
    int stage = 0;
    for (int line = warp; line < lines; line += WW) {
        const int next = (stage + S::STAGES - 1) % S::STAGES;
        issue_w(line + (S::STAGES - 1) * WW, next);
        issue_x(line + (S::STAGES - 1) * WW, next);
        cp_async_commit();
        cp_async_wait<S::STAGES - 1>();
        __syncwarp();  // the other lanes' copies of this stage have landed
        const uint8_t* st = my_ring + stage * S::STAGE_BYTES;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int off = frag_off + 16 * ((4 * u + t) ^ swz);
            uint4 xf[WIDE_MT], wl[NC], wh[NC];
#pragma unroll
            for (int mt = 0; mt < WIDE_MT; ++mt)
                xf[mt] = *reinterpret_cast<const uint4*>(st + (S::W_ROWS + 8 * mt) * 128 + off);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                wl[c] = *reinterpret_cast<const uint4*>(st + 16 * c * 128 + off);
                wh[c] = *reinterpret_cast<const uint4*>(st + (16 * c + 8) * 128 + off);
            }
#pragma unroll
            for (int h = 0; h < 4; ++h) {  // word h of each fragment (k's 4 h .. 4 h + 3): mt4's order
                uint32_t xl[WIDE_MT], xh[WIDE_MT];
#pragma unroll
                for (int mt = 0; mt < WIDE_MT; ++mt) e4m3x4_to_h2x2(word(xf[mt], h), xl[mt], xh[mt]);
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    uint32_t al, ah, bl, bh;  // rows g and g + 8: the pairs (k0, k1), (k2, k3)
                    e4m3x4_to_h2x2(word(wl[c], h), al, ah);
                    e4m3x4_to_h2x2(word(wh[c], h), bl, bh);
#pragma unroll
                    for (int mt = 0; mt < WIDE_MT; ++mt) mma_f16_16816(acc[c][mt], al, bl, ah, bh, xl[mt], xh[mt]);
                }
            }
        }
        __syncwarp();  // every lane has read the stage before the next issue refills it
        stage = (stage + 1) % S::STAGES;
    }
    cp_async_wait<0>();
    pdl_gemv_streamed();
    __syncthreads();  // every warp is done with the ring: it holds the sums now

    float(*red)[NC][WIDE_MT][4][32] = reinterpret_cast<float(*)[NC][WIDE_MT][4][32]>(ring);  // [WW]
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int mt = 0; mt < WIDE_MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) red[warp][c][mt][r][lane] = acc[c][mt][r];
    __syncthreads();

    // thread e (NC * 512 sums, 32 WW at a time) holds D register r of lane l of token tile mt of panel c, summed over
    // the warps in order: channel n0 + 16 c + l / 4 (+ 8 for r >= 2) of token m0 + 8 mt + 2 (l % 4) + (r & 1);
    // (c, mt, r) are warp-uniform, as fold8_store and swiglu_amax_store need
#pragma unroll
    for (int j = 0; j < NC * 16 / WW; ++j) {
        const int e = threadIdx.x + 32 * WW * j;
        const int l = e & 31, r = (e >> 5) & 3, mt = (e >> 7) & 3, c = e >> 9;
        auto red_sum = [&](int rr) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < WW; ++w) sum += red[w][c][mt][rr][l];
            return sum;
        };
        const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
        const int panel = blockIdx.y * NC + c;
        if (EPI == 2) {  // r 0, 1: gate channel l / 4 of the panel; r + 2: the matching up channel
            if (r >= 2 || panel >= N / 16) continue;  // warp-uniform
            float amax = 0.0f;
            if (m < M) {
                const float as = a_scale[(size_t)m * a_stride];
                const int n = 16 * panel + (l >> 2);
                const __half gate = fp8_epilogue(red_sum(r), as, w_scale[n], nullptr);
                const __half up = fp8_epilogue(red_sum(r + 2), as, w_scale[n + 8], nullptr);
                const __half a = __hmul_rn(silu_h(__half2float(gate)), up);
                y[(size_t)m * (N / 2) + panel * 8 + (l >> 2)] = a;
                amax = fabsf(__half2float(a));
            }
            if (part != nullptr) swiglu_amax_store(amax, l, m, M, part, panel, N / 16, nullptr);  // block-uniform
            continue;
        }
        const int n = 16 * panel + (l >> 2) + (r >= 2 ? 8 : 0);
        const bool folds = EPI == 1 && fold.xg != nullptr;  // block-uniform
        float sq = 0.0f, mx = 0.0f;
        if (n < N && m < M) {
            const size_t o = (size_t)m * N + n;
            const __half h = fp8_epilogue(red_sum(r), a_scale[(size_t)m * a_stride], w_scale[n],
                                          EPI == 1 ? residual + o : nullptr);
            y[o] = h;
            if (folds) fold8_values(fold, h, fold.w[n], o, sq, mx);
        }
        if (folds) fold8_store(fold, sq, mx, l, m, M, n, N);
    }
}

}  // namespace

// 32 token rows against 32 channels a block (fp8_gemv_wide; tuning.fp8_gemv_block_channels): the arguments of
// fp8_gemv_mt4, grid (ceil(M / 32), ceil(N / 32)), block 32 WW, dynamic shared memory the ring (fp8_gemm.py
// wide_ring). x8: one block a SM, x4: two (grids beyond the SMs, tuning.fp8_gemv_wide_two_blocks).
#define FLLAMA_FP8_GEMV_WIDE(NAME, WW, EPI)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * WW, 8 / WW)                                               \
        NAME(__half* y, const void* x, const float* a_scale, int a_stride, const uint8_t* w8,                   \
             const float* w_scale, const __half* residual, const __half* fold_w, __half* fold_xg, float* fold_sq, \
             float* fold_mx, float* part, int M, int N, int K) {                                                \
        fp8_gemv_wide<WW, EPI>(y, static_cast<const uint8_t*>(x), a_scale, a_stride, w8, w_scale, residual,     \
                                  Int8Fold{fold_w, fold_xg, fold_sq, fold_mx}, part, M, N, K);                  \
    }
#define FLLAMA_FP8_GEMV_WIDE_EPIS(NAME, WW)       \
    FLLAMA_FP8_GEMV_WIDE(NAME, WW, 0)             \
    FLLAMA_FP8_GEMV_WIDE(NAME##_res, WW, 1)       \
    FLLAMA_FP8_GEMV_WIDE(NAME##_silu, WW, 2)
FLLAMA_FP8_GEMV_WIDE_EPIS(fp8_gemv_w2x8, 8)
FLLAMA_FP8_GEMV_WIDE_EPIS(fp8_gemv_w2x4, 4)
