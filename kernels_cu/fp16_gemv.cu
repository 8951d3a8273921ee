// fp16 GEMV for decode (M <= 16 per 16-token tile): y[m, n] = fp16(sum_k x[m, k] * W[n, k]) (+ residual),
// fp32 accumulation, weight [N, K] row-major read once per 8 * MT tokens.
//
// Same tiling as int8_gemv (int8_gemm.cu): block = 8 warps owning 16 output channels, warps split K
// and meet in shared memory; per 32-wide k tile a lane takes 16 bytes (8 halves) of weight rows g and
// g + 8 and of activation row g, and feeds two m16n8k16 mma with A = weights, B = tokens (D = y^T).
// The lane's 8 halves go 4 + 4 to the two mma (a0/a2 = halves 0-1/2-3, then 4-5/6-7) and the activation
// halves the same way. The main loop is gemm_common.cuh gemv_mainloop, shared with int8_gemv: the weights
// arrive as whole 128-byte lines in a per-warp ring of dynamic shared memory (the launcher's shared=,
// gemm_shapes.gemv_shared), the activations straight into registers.
// The deferred RMSNorm (norm_fold.cuh), chosen at run time by non-null pointers: fold_w (EPI 1 only) makes
// this GEMV a producer (also xg = fp16(h * fold_w) and each panel's sum of h^2; N % 16 == 0), fold_in a
// consumer (x is xg, each token's sums scaled by its rstd before rounding).
// grid (ceil(N / 16), ceil(M / (8 * MT))), block 256.
//
// w8a16_gemv_mt{1,2}: the same GEMV on int8 weights with an fp32 scale per output channel (the engine's int8
// lm_head, EngineConfig.lm_head_int8): y[m, n] = fp16(scale[n] * sum_k x[m, k] * q[n, k]). Half the weight bytes
// through the same ring: a lane's 16 bytes of a row are 16 k's (TILE_K 64), its activations 32 bytes (GlobalX32),
// and each byte becomes an exact fp16 (i8x4_to_h2x2) for the same m16n8k16 mma; the scale multiplies the fp32 sum.
// grid (ceil(M / (8 * MT)), ceil(N / 16)): the token tiles of a panel side by side. w8a16_gemv_mt1_w4: 4 warps
// (block 128) for short rows (fp16_gemv.py: w8a16_warps), where 8 warps would each stream one step and exit.
#include "gemm_common.cuh"
#include "norm_fold.cuh"

using namespace fllama;

namespace {

constexpr int UNROLL = 4;

// The main loop's hook for a deferred-norm consumer (fold_in non-null): the partial sums towards L1 right
// after the PDL wait (norm_fold.cuh).
template <int WARPS>
struct FoldHook {
    const float* fold_in;
    int m0, rows, K;
    __device__ __forceinline__ void operator()() const {
        if (fold_in != nullptr) fold_prefetch<WARPS>(fold_in, m0, rows, K / 16);
    }
};

// The int8 weights' mma: a lane's words of rows g / g + 8 (a0, a1: k's kq..kq + 3; a2, a3: kq + 4..kq + 7) and
// the 8 activations of those k's (x: 4 words of k pairs), as two m16n8k16 mma of 4 k's each (the k order inside
// an mma is free as long as A and B agree: a0/a2 = pairs (kq, kq + 1) / (kq + 2, kq + 3) of row g, b0/b1 the same).
struct W8Mma {
    __device__ __forceinline__ void operator()(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               const uint4& x) const {
        uint32_t lo0, hi0, lo1, hi1;
        i8x4_to_h2x2(a0, lo0, hi0);
        i8x4_to_h2x2(a1, lo1, hi1);
        mma_f16_16816(c, lo0, lo1, hi0, hi1, x.x, x.y);
        i8x4_to_h2x2(a2, lo0, hi0);
        i8x4_to_h2x2(a3, lo1, hi1);
        mma_f16_16816(c, lo0, lo1, hi0, hi1, x.z, x.w);
    }
};

// EPI: 0 plain, 1 + residual, 2 SwiGLU of a gate|up weight interleaved by 8 (block rows 0-7 = gate
// channels 8b.., rows 8-15 = the same up channels): y [M, N / 2] = fp16(silu(fp16 gate)) * fp16 up.
// WT: __half weights, or int8_t with w_scale (fp32 [N]; the w8a16 entries, EPI 0 only). WARPS split K.
template <int MT, int EPI, typename WT = __half, int WARPS = 8>
__device__ __forceinline__ void fp16_gemv(__half* __restrict__ y, const __half* __restrict__ x,
                                          const WT* __restrict__ weight, const __half* __restrict__ residual,
                                          int M, int N, int K, const __half* __restrict__ fold_w,
                                          __half* __restrict__ fold_xg, float* __restrict__ fold_part,
                                          const float* __restrict__ fold_in, float eps,
                                          const float* __restrict__ w_scale = nullptr, int res_early = 0) {
    constexpr bool W8 = sizeof(WT) == 1;
    static_assert(!W8 || EPI == 0, "int8 weights: the plain epilogue (the lm_head)");
    static_assert(32 * WARPS >= MT * 128, "the epilogue takes a thread per (token tile, accumulator, lane)");
    constexpr int TILE_K = 64 / sizeof(WT);  // k's of a row's 64 bytes
    constexpr int LANE_K = 16 / sizeof(WT);  // k's of a lane's 16 bytes
    __shared__ float red[WARPS][MT][4][32];
    __shared__ float s_rstd[8 * MT];
    extern __shared__ __align__(128) uint8_t gemv_ring[];  // the main loop's (gemm_common.cuh)
    if (dynamic_smem_size() < gemv_ring_bytes<WARPS, UNROLL>()) __trap();  // the launcher's shared=
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // int8 weights: grid (token tiles, panels), so that a panel's token tiles are neighbouring blocks and share its
    // lines in L2 (each tile's block still converts every weight of the panel)
    const int n0 = (W8 ? blockIdx.y : blockIdx.x) * 16;
    const int m0 = (W8 ? blockIdx.x : blockIdx.y) * 8 * MT;
    const int rows = min(M - m0, 8 * MT);

    bool x_ok[MT];
    const __half* x_row[MT];
    token_rows<MT>(x, M, K, m0, g, LANE_K * t, x_ok, x_row);

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0.0f;
    // the producer's norm weight (channels g, g + 8) before the main loop: it does not wait for the previous kernel
    __half2 nw = __float2half2_rn(0.0f);  // (channel g, channel g + 8)
    if (EPI == 1 && fold_w != nullptr) nw = __halves2half2(fold_w[n0 + g], fold_w[n0 + g + 8]);
    // res_early: this epilogue thread's residual before the main loop's PDL wait (norm_fold.cuh residual_ahead)
    __half2 rp = __float2half2_rn(0.0f);
    if (EPI == 1 && res_early != 0 && threadIdx.x < MT * 128) {
        const int r = (threadIdx.x >> 5) & 3;
        rp = residual_ahead(residual, fold_w != nullptr, r, m0 + (threadIdx.x >> 7) * 8 + 2 * (lane & 3) + (r & 1), M,
                            N, n0 + (lane >> 2));
    }

    if constexpr (W8) {
        gemv_mainloop<WARPS, UNROLL, TILE_K>(weight, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, LANE_K * t, warp, M,
                                             acc, W8Mma{}, FoldHook<WARPS>{fold_in, m0, rows, K}, GlobalX32{});
    } else {
        gemv_mainloop<WARPS, UNROLL, TILE_K>(weight, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, LANE_K * t, warp, M,
                                             acc,
                                             [](auto& c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                uint32_t b0, uint32_t b1) { mma_f16_16816(c, a0, a1, a2, a3, b0, b1); },
                                             FoldHook<WARPS>{fold_in, m0, rows, K});
    }
    // the deferred norm: each warp's rstd (its 8 MT / WARPS tokens), read by all after the barrier below
    constexpr int TPW = (8 * MT + WARPS - 1) / WARPS;  // tokens a warp
    if (fold_in != nullptr) fold_rstd<WARPS, TPW>(s_rstd, fold_in, m0, rows, K / 16, K, eps);

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = acc[mt][r];
    __syncthreads();  // red, and the deferred norm's s_rstd

    if (threadIdx.x >= MT * 128) return;
    const int mt = threadIdx.x >> 7, r = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
    const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
    auto red_sum = [&](int rr) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += red[w][mt][rr][l];
        return sum;
    };
    if (EPI == 1 && fold_w != nullptr) {  // producer: a thread takes rows r and r + 2 (channels g, g + 8) of a token
        if (r < 2 && res_early != 0)       // warp-uniform
            fold_store_res(y, fold_xg, fold_part, rp, nw, red_sum(r), red_sum(r + 2), m, M, N, n0 + (l >> 2),
                           blockIdx.x);
        else if (r < 2)
            fold_store(y, fold_xg, fold_part, residual, nw, red_sum(r), red_sum(r + 2), m, M, N,
                       n0 + (l >> 2), blockIdx.x);
        return;
    }
    const float rstd = fold_in != nullptr && m < M ? s_rstd[m - m0] : 1.0f;
    float sum = fold_in != nullptr ? red_sum(r) * rstd : red_sum(r);
    if (EPI == 2) {  // r 0, 1: gate channel g of this block; r + 2: the matching up channel (same order)
        if (r < 2 && m < M) {
            const float up_sum = fold_in != nullptr ? red_sum(r + 2) * rstd : red_sum(r + 2);
            const __half gate = __float2half_rn(sum), up = __float2half_rn(up_sum);
            y[(size_t)m * (N / 2) + blockIdx.x * 8 + (l >> 2)] = __hmul_rn(silu_h(__half2float(gate)), up);
        }
        return;
    }
    const int n = n0 + (l >> 2) + (r >= 2 ? 8 : 0);
    if (n < N && m < M) {
        if constexpr (W8) sum *= w_scale[n];
        const size_t o = (size_t)m * N + n;
        const __half h = __float2half_rn(sum);
        // fp16 add after rounding, like the reference
        y[o] = EPI == 1 ? __hadd_rn(h, res_early != 0 ? __low2half(rp) : residual[o]) : h;
    }
}

}  // namespace

// (y fp16 [M,N], x fp16 [M,K], weight fp16 [N,K], residual fp16 [M,N] or null, int M, int N, int K,
//  fold_w fp16 [N] or null, fold_xg fp16 [M,N], fold_part f32 [M,N/16], fold_in f32 [M,K/16] or null, float eps,
//  int res_early: the residual read before the PDL wait (its writer two kernels back: fp16_gemv.py)
#define FLLAMA_FP16_GEMV(NAME, MT, EPI)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                       \
        NAME(__half* y, const __half* x, const __half* weight, const __half* residual, int M, int N, int K,  \
             const __half* fold_w, __half* fold_xg, float* fold_part, const float* fold_in, float eps,      \
             int res_early) {                                                                               \
        fp16_gemv<MT, EPI>(y, x, weight, residual, M, N, K, fold_w, fold_xg, fold_part, fold_in, eps,       \
                           nullptr, res_early);                                                             \
    }

FLLAMA_FP16_GEMV(fp16_gemv_mt1, 1, 0)
FLLAMA_FP16_GEMV(fp16_gemv_mt2, 2, 0)
FLLAMA_FP16_GEMV(fp16_gemv_mt1_res, 1, 1)
FLLAMA_FP16_GEMV(fp16_gemv_mt2_res, 2, 1)
FLLAMA_FP16_GEMV(fp16_gemv_mt1_silu, 1, 2)
FLLAMA_FP16_GEMV(fp16_gemv_mt2_silu, 2, 2)

// (y fp16 [M,N], x fp16 [M,K], qweight int8 [N,K], w_scale f32 [N], int M, int N, int K, fold_in f32 [M,K/16] or
//  null, float eps)
#define FLLAMA_W8A16_GEMV(NAME, MT, WARPS, BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS)                                        \
        NAME(__half* y, const __half* x, const int8_t* qweight, const float* w_scale, int M, int N, int K,  \
             const float* fold_in, float eps) {                                                             \
        fp16_gemv<MT, 0, int8_t, WARPS>(y, x, qweight, nullptr, M, N, K, nullptr, nullptr, nullptr, fold_in, \
                                        eps, w_scale);                                                      \
    }

// One token tile in 80 registers: three blocks a SM, as the ring's shared memory allows (104 registers, two blocks,
// without the cap); two tiles keep two blocks (the cap of three spills 188 bytes). 4 warps: six blocks a SM, the
// same warps and ring bytes.
FLLAMA_W8A16_GEMV(w8a16_gemv_mt1, 1, 8, 3)
FLLAMA_W8A16_GEMV(w8a16_gemv_mt2, 2, 8, 2)
FLLAMA_W8A16_GEMV(w8a16_gemv_mt1_w4, 1, 4, 6)
