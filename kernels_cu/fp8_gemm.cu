// FP8 E4M3 W8A8 decode GEMV (model_zoo/quant/fp8.py's contract, fp8_common.cuh):
//   y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])  (+ residual[m, n]),  acc = sum_k x8[m, k] * w8[n, k] in fp32
//
// fp8_gemv_mt{1,2,4}[_res]: the memory-bound decode kernel, int8_gemm.cu's tiling with e4m3 operands: block = 8 warps
//   owning 16 output channels, the warps split K and meet in shared memory; per 64-wide k tile a lane takes 16
//   bytes of weight rows g and g + 8 (from gemm_common.cuh's ring of whole lines in dynamic shared memory) and 16
//   codes of its token row g (per 8-token tile), converts both to exact fp16 pairs in registers (cvt e4m3x2 ->
//   f16x2) and feeds four m16n8k16 mma (Fp8Mma): weights the A operand (16 channels), tokens the B operand (8
//   tokens), so D = y^T and M <= 8 wastes no weight bandwidth. Every weight byte is read once per 8 MT tokens,
//   the same bytes as the int8 GEMV; a block converts each weight fragment once for its MT token tiles (MT 4: 32
//   rows, steps of two tiles so that their codes fit the registers; mt4a: the weights by integer ops, Fp8MmaAluW).
//   _res can also write the next RMSNorm's inputs (Int8Fold, int8's format: the deferred chain of 2-64 rows).
// fp8_gemv_w2x{4,8}[_res|_silu]: the same 32-row GEMV with 32 channels a block (two panels a warp), the token rows
//   staged in shared memory beside the weight lines (fp8_gemv_wide.cu; tuning.fp8_gemv_block_channels).
// fp8_gemv_mt{1,2,4}_silu: the same for a gate|up weight interleaved by 8 (swiglu_layout.py: block rows 0-7 = gate
//   channels 8b.., rows 8-15 = the same up channels; w_scale in the same order), with the SwiGLU in the epilogue:
//   y [M, N / 2] = fp16(silu(fp16 gate)) * fp16 up (silu_mul.cu's rounding of the two products), and optionally
//   each 8 channels' max |y| (for the down_proj's fp8_quantize_fold).
// fp8_gemv_xq[_res|_silu]: the same for up to 8 fp16 token rows that the kernel quantizes itself (fp8_quantize's
//   work, so the decode step has no quantize kernel before the GEMV): after the PDL wait every block finds its rows'
//   max |x| (Fp8AmaxHook: one read of the rows from L2, one barrier), and each lane turns its 16 fp16 values a tile
//   into their e4m3 codes as exact fp16 values (Fp8QuantX) for the same mma. The codes, scales and sums are
//   fp8_quantize + fp8_gemv's, bit for bit. Every block reads the whole rows, so the engine uses it for few rows
//   (tuning.fp8_xq_max_rows).
// fp8_gemv_nq[_silu]: the same for up to 8 rows of an RMSNorm's input h (q|k|v and gate|up of a one-row decode
//   step, with no norm kernel before them): the prologue (Fp8NormHook) computes each row's 1 / rms exactly as
//   rmsnorm.cu does (its sum of squares in the norm kernel's order) and the max of y = w * fp16(h / rms), and each
//   lane computes its tile's y and codes in registers (Fp8NormQuantX): rmsnorm + fp8_quantize + fp8_gemv's bits.
// fp8_gemv_xq1[_res|_silu], fp8_gemv_nq1[_silu]: the same for ONE row (the batch-1 decode step), where the loaders
//   above would have each of the 32 lanes quantize 16 values a tile for its own token row (7 of 8 of them empty):
//   Fp8RowQuantX / Fp8NormRowQuantX spread the row's 64 values a tile over the warp (lane (g, t) values 16 t + 2 g,
//   +1: one 4-byte read, one pair quantized) and gather each t's 8 words with shuffles. Every lane then holds
//   token 0's values (the mma's columns 1-7 repeat column 0 and are never stored). The same codes, products and
//   sums as the 8-row entries: bit for bit; ~2.4x fewer instructions a weight byte in the main loop.
// fp8_gemv_dq1[_res], fp8_gemv_fq1[_silu]: the same loader fed by int8's one-row deferred chain (deferred_quant.cuh):
//   the row's scale from maxima that the kernel before wrote (XqRowHook), or a deferred RMSNorm's xg quantized from
//   its producer's maxima and sums (NormRowHook), so no block reads a whole row before its first mma.
// grid (ceil(M / (8 MT)), ceil(N / 16)): a panel's token tiles are neighbouring blocks and share its lines in L2
// (each still converts every weight of the panel), which lets the engine use it up to tuning.fp8_gemv_max_m rows.
#include "fp8_common.cuh"
#include "fp8_gemv_quant.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = FP8_GEMV_WARPS;
constexpr int UNROLL = 4;  // 64-wide k tiles per warp step: 16 rows x 256 bytes of weight lines
constexpr int TILE_K = 64;

// EPI: 0 plain, 1 + residual, 2 SwiGLU (N = the weight's 2F rows, y [M, N / 2]).
// XQ: XQ_CODES x8 and a_scale; XQ_X x16 fp16 [M, K] (and static_scale, or null for per-token scales) instead;
// XQ_NORM x16 an RMSNorm's input h, with nq its weight and launch shape (MT 1 for both). ROW: M == 1 (the *1 entries).
// The deferred one-row modes (the batch-1 decode chain, int8's, deferred_quant.cuh; Fp8RowQuantX's loop):
// XQ_PART x16 with its row max from the kernel before (dq.part_in: attention's units; dq.row_amax_in: the SwiGLU
// GEMV's atomic max; both null: static_scale); XQ_FOLD a deferred RMSNorm (dq.nq: xg and its producer's partials).
// dq.fold (EPI 1): the next norm's inputs written (Int8Fold); dq.part_out / row_amax_out (EPI 2): the SwiGLU's maxima.
// XQ_VALUES: x16 the exact fp16 values of e4m3 codes [M, K] (fp8_quantize_fold's values) with a_scale, as XQ_CODES:
// no conversion of the activations in the loop (the h entries).
enum XqMode { XQ_CODES = 0, XQ_X = 1, XQ_NORM = 2, XQ_PART = 3, XQ_FOLD = 4, XQ_VALUES = 5 };
struct NormArgs {
    const __half* w;  // the norm weight [K]
    float eps;
    int vt, nv;  // rmsnorm.cu's launch for a row of K: threads, vectors a thread
};
struct DeferArgs {
    const float* part_in;
    int C;
    const float* row_amax_in;
    float* part_out;
    float* row_amax_out;
    Int8Fold fold;
    NormQ nq;
};
template <int MT, int EPI, int XQ, bool ROW = false, bool WALU = false>
__device__ __forceinline__ void fp8_gemv(__half* __restrict__ y, const uint8_t* __restrict__ x8,
                                         const float* __restrict__ a_scale, int a_stride,
                                         const __half* __restrict__ x16, const float* __restrict__ static_scale,
                                         NormArgs nq, const uint8_t* __restrict__ w8,
                                         const float* __restrict__ w_scale, const __half* residual, int M, int N,
                                         int K, DeferArgs dq = {}) {
    static_assert(XQ == XQ_CODES || XQ == XQ_VALUES || MT == 1, "the self-quantizing GEMV holds 8 token rows");
    static_assert(!ROW || XQ != XQ_CODES, "the one-row loaders quantize fp16 rows");
    static_assert(ROW || (XQ != XQ_PART && XQ != XQ_FOLD), "the deferred modes take one row");
    if (ROW && M != 1) __trap();  // the launcher's rule (fp8_gemm.py)
    // 32 token rows, or fp16 values: half the step, so the x tiles in flight fit registers
    constexpr int U = MT == 4 || XQ == XQ_VALUES ? 2 : UNROLL;
    __shared__ float red[WARPS][MT][4][32];
    __shared__ float s_scale[8], s_inv[8], s_rinv[8], s_red[8 * WARPS];
    extern __shared__ __align__(128) uint8_t gemv_ring[];  // the main loop's (gemm_common.cuh)
    if (dynamic_smem_size() < gemv_ring_bytes<WARPS, U>()) __trap();  // the launcher's shared=
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * 8 * MT, n0 = blockIdx.y * 16;
    if constexpr (XQ == XQ_FOLD) x16 = dq.nq.xg;

    // the epilogue's channel (below) and the deferred norm's weight for it: a weight, loaded before the PDL wait at
    // one row (dq1_res, where the tail is the kernel's latency), else after the main loop, whose registers it crowds
    const int n_epi = n0 + (lane >> 2) + ((warp & 2) ? 8 : 0);
    __half fold_w = __float2half_rn(0.0f);
    auto load_fold_w = [&] {
        if (EPI == 1 && dq.fold.xg != nullptr && warp < 4 * MT && n_epi < N) fold_w = dq.fold.w[n_epi];
    };
    if (XQ == XQ_PART) load_fold_w();

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0.0f;
    if constexpr (XQ == XQ_VALUES) {
        bool x_ok[MT];
        const __half* x_row[MT];
        token_rows<MT>(x16, M, K, m0, g, 16 * t, x_ok, x_row);
        gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M, acc,
                                        Fp8MmaX16{}, NoHook{}, GlobalX32{});
    } else if constexpr (XQ != XQ_CODES) {
        bool x_ok[1];
        const __half* x_row[1];
        if constexpr (ROW) {  // every lane reads row 0 (its pair of each tile); x_row carries the chunk offset
            x_ok[0] = true;
            x_row[0] = x16 + 16 * t;
        } else {
            token_rows<1>(x16, M, K, m0, g, 16 * t, x_ok, x_row);
        }
        const int rows = min(M - m0, 8);
        const int hg = ROW ? 0 : g;  // the token row whose scales the lane's loader uses
        float inv = 0.0f, rinv = 0.0f;  // that row's 1 / a_scale (and 1 / rms): found by the hook
        if constexpr (XQ == XQ_PART) {
            const XqRowHook<Fp8Rule> hook{&inv, s_scale, dq.part_in, static_scale, dq.row_amax_in, dq.C, m0};
            gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M, acc,
                                                 Fp8MmaX16{}, hook, Fp8RowQuantX{&inv, g, t});
        } else if constexpr (XQ == XQ_FOLD) {
            const NormRowHook<Fp8Rule> hook{&inv, s_scale, s_red, dq.nq, K, blockIdx.x == 0 && blockIdx.y == 0};
            gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M, acc,
                                                 Fp8MmaX16{}, hook, Fp8RowQuantX{&inv, g, t});
        } else if constexpr (XQ == XQ_X) {
            const Fp8AmaxHook hook{&inv, s_scale, s_inv, s_red, x16, static_scale, m0, rows, K, hg};
            if constexpr (ROW) {
                gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M,
                                                     acc, Fp8MmaX16{}, hook, Fp8RowQuantX{&inv, g, t});
            } else {
                gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M,
                                                     acc, Fp8MmaX16{}, hook, Fp8QuantX{&inv});
            }
        } else {
            const Fp8NormHook hook{&rinv, &inv, s_scale, s_inv, s_rinv, s_red, x16, nq.w, static_scale, nq.eps,
                                   nq.vt, nq.nv, m0, rows, K, hg};
            const Fp8NormQuantX q{x_row[0] - 16 * t, nq.w, &rinv, &inv};
            if constexpr (ROW) {
                gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M,
                                                     acc, Fp8MmaX16{}, hook, Fp8NormRowQuantX{q, g, t});
            } else {
                gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M,
                                                     acc, Fp8MmaX16{}, hook, q);
            }
        }
    } else {
        bool x_ok[MT];
        const uint8_t* x_row[MT];
        token_rows<MT>(x8, M, K, m0, g, 16 * t, x_ok, x_row);
        if constexpr (WALU) {
            gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M, acc,
                                            Fp8MmaAluW{});
        } else {
            gemv_mainloop<WARPS, U, TILE_K>(w8, n0, n0 + 8, N, gemv_ring, x_row, x_ok, K, 16 * t, warp, M, acc,
                                            Fp8Mma{});
        }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = WALU ? acc[mt][r] * FP8_ALU_UNSCALE : acc[mt][r];
    if (XQ != XQ_PART) load_fold_w();
    __syncthreads();  // red, and XQ's s_scale

    // MT * 128 partial sums per warp; thread e (e < MT * 128, 256 at a time: one each up to MT 2, two at MT 4) holds
    // thread (r, l) of token tile mt's: D register r of lane l, i.e. channel n0 + l / 4 (+ 8 for r >= 2) of token
    // m0 + 8 mt + 2 (l % 4) + (r & 1); r = warp & 3 for every e of a thread (n_epi, fold_w), and e is warp-uniform
#pragma unroll
    for (int j = 0; j < (MT + 1) / 2; ++j) {
        const int e = threadIdx.x + 32 * WARPS * j;
        if (e >= MT * 128) break;  // warp-uniform
        const int mt = e >> 7, r = (e >> 5) & 3, l = e & 31;
        auto red_sum = [&](int rr) { return warps_sum(red, mt, rr, l); };
        const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
        auto scale_of = [&](int mm) {
            return XQ != XQ_CODES && XQ != XQ_VALUES ? s_scale[mm - m0] : a_scale[(size_t)mm * a_stride];
        };
        if (EPI == 2) {  // r 0, 1: gate channel l / 4 of this panel; r + 2: the matching up channel
            if (r >= 2) continue;  // warp-uniform
            float amax = 0.0f;
            if (m < M) {
                const float as = scale_of(m);
                const int n = n0 + (l >> 2);
                const __half gate = fp8_epilogue(red_sum(r), as, w_scale[n], nullptr);
                const __half up = fp8_epilogue(red_sum(r + 2), as, w_scale[n + 8], nullptr);
                const __half a = __hmul_rn(silu_h(__half2float(gate)), up);
                y[(size_t)m * (N / 2) + blockIdx.y * 8 + (l >> 2)] = a;
                amax = fabsf(__half2float(a));
            }
            if (dq.part_out != nullptr)  // block-uniform
                swiglu_amax_store(amax, l, m, M, dq.part_out, blockIdx.y, gridDim.y, dq.row_amax_out);
            continue;
        }
        const int n = n_epi;  // n0 + (l >> 2) + (r >= 2 ? 8 : 0): this thread is lane l of warp r
        float sq = 0.0f, mx = 0.0f;
        if (n < N && m < M) {
            const size_t o = (size_t)m * N + n;
            const __half h = fp8_epilogue(red_sum(r), scale_of(m), w_scale[n], EPI == 1 ? residual + o : nullptr);
            y[o] = h;
            if (EPI == 1 && dq.fold.xg != nullptr) fold8_values(dq.fold, h, fold_w, o, sq, mx);
        }
        if (EPI == 1 && dq.fold.xg != nullptr) fold8_store(dq.fold, sq, mx, l, m, M, n, N);  // block-uniform
    }
}

}  // namespace

// (y fp16 [M,N] (SwiGLU: [M,N/2]), x8 e4m3 [M,K], a_scale f32 [M] or [1], int a_stride (1 or 0), w8 e4m3 [N,K],
//  w_scale f32 [N], residual fp16 [M,N] or null, fold_w fp16 [N] or null, fold_xg fp16 [M,N], fold_sq f32 [M,N/8],
//  fold_mx f32 [M,N/8] (with the residual: the next norm deferred, int8's format), part f32 [M,N/16] or null (SwiGLU:
//  max |y| per 8 channels, for the down_proj's fp8_quantize_fold), int M, int N, int K); K % 16 == 0 (SwiGLU:
//  N % 16 == 0); registers for three blocks a SM at MT 1 (h1 capped at 80), two beyond (MT 4 capped at 128).
//  grid (ceil(M / (8 MT)), ceil(N / 16)), block 256, dynamic shared memory the ring (gemm_shapes.gemv_shared; half
//  of it at MT 4, whose steps are two tiles).
#define FLLAMA_FP8_GEMV_W(NAME, MT, EPI, WALU, XQ)                                                               \
    extern "C" __global__ void __launch_bounds__(256, MT == 4 ? 2 : MT == 1 && XQ == XQ_VALUES ? 3 : 1)         \
        NAME(__half* y, const void* x, const float* a_scale, int a_stride, const uint8_t* w8,                    \
             const float* w_scale, const __half* residual, const __half* fold_w, __half* fold_xg, float* fold_sq, \
             float* fold_mx, float* part, int M, int N, int K) {                                                 \
        fp8_gemv<MT, EPI, XQ, false, WALU>(                                                                      \
            y, static_cast<const uint8_t*>(x), a_scale, a_stride, static_cast<const __half*>(x), nullptr,        \
            NormArgs{}, w8, w_scale, residual, M, N, K,                                                          \
            DeferArgs{nullptr, 0, nullptr, part, nullptr, Int8Fold{fold_w, fold_xg, fold_sq, fold_mx}, NormQ{}}); \
    }
#define FLLAMA_FP8_GEMV(NAME, MT, EPI) FLLAMA_FP8_GEMV_W(NAME, MT, EPI, false, XQ_CODES)

FLLAMA_FP8_GEMV(fp8_gemv_mt1, 1, 0)
FLLAMA_FP8_GEMV(fp8_gemv_mt2, 2, 0)
FLLAMA_FP8_GEMV(fp8_gemv_mt1_res, 1, 1)
FLLAMA_FP8_GEMV(fp8_gemv_mt2_res, 2, 1)
FLLAMA_FP8_GEMV(fp8_gemv_mt1_silu, 1, 2)
FLLAMA_FP8_GEMV(fp8_gemv_mt2_silu, 2, 2)
// 32 token rows a block (one block a panel at the batch-32 step: each weight fragment converted once for them)
FLLAMA_FP8_GEMV(fp8_gemv_mt4, 4, 0)
FLLAMA_FP8_GEMV(fp8_gemv_mt4_res, 4, 1)
FLLAMA_FP8_GEMV(fp8_gemv_mt4_silu, 4, 2)
// ... with the weights converted on the integer pipe (Fp8MmaAluW: the same sums; tuning.fp8_gemv_alu_weights)
FLLAMA_FP8_GEMV_W(fp8_gemv_mt4a, 4, 0, true, XQ_CODES)
FLLAMA_FP8_GEMV_W(fp8_gemv_mt4a_res, 4, 1, true, XQ_CODES)
FLLAMA_FP8_GEMV_W(fp8_gemv_mt4a_silu, 4, 2, true, XQ_CODES)
// x: the fp16 values of the codes (fp8_quantize_fold's values), no activation conversion in the loop; 8 or 16 rows
// a block, steps of two tiles
FLLAMA_FP8_GEMV_W(fp8_gemv_h1, 1, 0, false, XQ_VALUES)
FLLAMA_FP8_GEMV_W(fp8_gemv_h1_res, 1, 1, false, XQ_VALUES)
FLLAMA_FP8_GEMV_W(fp8_gemv_h1_silu, 1, 2, false, XQ_VALUES)
FLLAMA_FP8_GEMV_W(fp8_gemv_h2, 2, 0, false, XQ_VALUES)
FLLAMA_FP8_GEMV_W(fp8_gemv_h2_res, 2, 1, false, XQ_VALUES)
FLLAMA_FP8_GEMV_W(fp8_gemv_h2_silu, 2, 2, false, XQ_VALUES)

// The self-quantizing entries: (y, x fp16 [M,K], static_scale f32 [1] or null (per-token scales), w8, w_scale,
//  residual or null, int M, int N, int K); grid (ceil(M / 8), ceil(N / 16)), as fp8_gemv_mt1.
// fp8_gemv_xq1*: the same arguments, M == 1 (the one-row loader).
#define FLLAMA_FP8_GEMV_XQ(NAME, EPI, ROW)                                                                       \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        NAME(__half* y, const __half* x, const float* static_scale, const uint8_t* w8, const float* w_scale,     \
             const __half* residual, int M, int N, int K) {                                                      \
        fp8_gemv<1, EPI, XQ_X, ROW>(y, nullptr, nullptr, 0, x, static_scale, NormArgs{}, w8, w_scale, residual,  \
                                    M, N, K);                                                                    \
    }

FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq, 0, false)
FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq_res, 1, false)
FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq_silu, 2, false)
FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq1, 0, true)
FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq1_res, 1, true)
FLLAMA_FP8_GEMV_XQ(fp8_gemv_xq1_silu, 2, true)

// One to 8 rows of an RMSNorm's input, normalized and quantized in the GEMV: (y, h fp16 [M,K], norm_w fp16 [K],
//  float eps, int vt, int nv (rmsnorm.cu's row launch for K: threads <= 256, vectors a thread), static_scale f32 [1]
//  or null, w8, w_scale, int M, int N, int K); grid (ceil(M / 8), ceil(N / 16)), as fp8_gemv_mt1. Capped at 80
//  registers (no spills): three blocks a SM as the ring's shared memory allows, where h's and w's next tiles in
//  flight take 102 registers (two blocks) without the cap.
//  fp8_gemv_nq1*: the same arguments, M == 1 (the one-row loader).
#define FLLAMA_FP8_GEMV_NQ(NAME, EPI, ROW)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                         \
        NAME(__half* y, const __half* h, const __half* norm_w, float eps, int vt, int nv,                        \
             const float* static_scale, const uint8_t* w8, const float* w_scale, int M, int N, int K) {          \
        fp8_gemv<1, EPI, XQ_NORM, ROW>(y, nullptr, nullptr, 0, h, static_scale, NormArgs{norm_w, eps, vt, nv},   \
                                       w8, w_scale, nullptr, M, N, K);                                           \
    }

FLLAMA_FP8_GEMV_NQ(fp8_gemv_nq, 0, false)
FLLAMA_FP8_GEMV_NQ(fp8_gemv_nq_silu, 2, false)
FLLAMA_FP8_GEMV_NQ(fp8_gemv_nq1, 0, true)
FLLAMA_FP8_GEMV_NQ(fp8_gemv_nq1_silu, 2, true)

// The deferred one-row entries (the batch-1 decode chain, as int8's _xq1 / _nq1 with the same arguments):
// fp8_gemv_dq1[_res]: (y fp16 [1,N], x fp16 [1,K], part f32 [1,C] or null, int C, row_amax f32 [1] or null (the row's
//  max itself, read instead of part), static_scale f32 [1] (with both null), w8, w_scale, residual or null, fold_w
//  fp16 [N] or null, fold_xg fp16 [1,N], fold_sq f32 [1,N/8], fold_mx f32 [1,N/8] (the next norm deferred, with the
//  residual only), int M (1), int N, int K); grid (1, ceil(N / 16)), dynamic shared memory the ring. Capped at 80
//  registers (no spills): three blocks a SM, as the one-row entries above.
#define FLLAMA_FP8_GEMV_DQ(NAME, EPI)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                            \
        NAME(__half* y, const __half* x, const float* part, int C, const float* row_amax,                        \
             const float* static_scale, const uint8_t* w8, const float* w_scale, const __half* residual,         \
             const __half* fold_w, __half* fold_xg, float* fold_sq, float* fold_mx, int M, int N, int K) {       \
        fp8_gemv<1, EPI, XQ_PART, true>(y, nullptr, nullptr, 0, x, static_scale, NormArgs{}, w8, w_scale,        \
                                        residual, M, N, K,                                                       \
                                        DeferArgs{part, C, row_amax, nullptr, nullptr,                           \
                                                  Int8Fold{fold_w, fold_xg, fold_sq, fold_mx}, NormQ{}});        \
    }
FLLAMA_FP8_GEMV_DQ(fp8_gemv_dq1, 0)
FLLAMA_FP8_GEMV_DQ(fp8_gemv_dq1_res, 1)

// fp8_gemv_fq1[_silu]: one row of a deferred RMSNorm: (y fp16 [1,N] or [1,N/2], part f32 [1,N/16] (SwiGLU) or null,
//  row_amax f32 [1] or null (SwiGLU: the row's max, atomically; zero on entry), xg fp16 [1,K], mx f32 [1,C], sq f32
//  [1,C] or null, static_scale f32 [1] or null, float eps, int C, zero f32 [1] or null (set to 0 by the first block),
//  w8, w_scale, int M (1), int N, int K); grid (1, ceil(N / 16)), dynamic shared memory the ring.
#define FLLAMA_FP8_GEMV_FQ(NAME, EPI)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                            \
        NAME(__half* y, float* part, float* row_amax, const __half* xg, const float* mx, const float* sq,        \
             const float* static_scale, float eps, int C, float* zero, const uint8_t* w8, const float* w_scale,   \
             int M, int N, int K) {                                                                              \
        fp8_gemv<1, EPI, XQ_FOLD, true>(y, nullptr, nullptr, 0, nullptr, static_scale, NormArgs{}, w8, w_scale,  \
                                        nullptr, M, N, K,                                                        \
                                        DeferArgs{nullptr, 0, nullptr, part, row_amax, Int8Fold{},               \
                                                  NormQ{xg, mx, sq, static_scale, zero, eps, C}});               \
    }
FLLAMA_FP8_GEMV_FQ(fp8_gemv_fq1, 0)
FLLAMA_FP8_GEMV_FQ(fp8_gemv_fq1_silu, 2)
