// AWQ W4A16 decode GEMV on the engine's own int4 layout (awq_gemv.py repacks AutoAWQ's GEMM tensors once,
// at load): y[m, n] = sum over groups of s[g, n] * sum_{k in g} (q[k, n] - z[g, n]) * x[m, k].
//
// Why another layout: in AutoAWQ's [K, N/8] words a lane's 16-byte load holds 4 rows x 8 columns, which
// must be transposed (prmt) and scaled per pair before an mma can use it; the kernel that reads it
// directly (awq_gemm.cu) is instruction-bound at ~40-50% of the bandwidth. Here every lane's 16 bytes
// are already 32 k-values of ONE output channel, nibbles placed so that the four LOP3 extractions of a
// word give A-fragment pairs of an m16n8k16 mma as they come:
//   block = W = 4 (or 8, the *_w8 entries) warps on a panel of 16 output channels (rows g and g + 8 of the
//   mma, as fp16_gemv.cu), the warps taking turns over the panel's 128-k tiles and meeting in shared memory
//   at the end (warps 0-3 sum and write);
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
// Entry points awq_gemv_mt{MT}_g{GPT}_{plain|res|silu}(y, x, packed, terms, residual, M, N, K, tiles, fold_w,
//   fold_xg, fold_part, fold_in, eps), grid (N / 16, ceil(M / (8 * MT))), block 128; awq_gemv_mt1_g1_*_w8
//   the same with block 256.
// awq_packed_dequant: w_hat [N, K] fp16 = fp16((q - z) * s) from the same layout (prefill, then cuBLAS).
#include "awq_gemv.cuh"

using namespace fllama;
using awq::TILE_K;

namespace {

// One block, one panel (blockIdx.x) and 8 MT tokens (blockIdx.y): the panel's first weights are in flight
// before the PDL wait, the next kernel is let in after the main loop.
template <int MT, int GPT, int EPI, int U, int W>
__device__ __forceinline__ void awq_gemv(__half* y, const __half* x, const uint32_t* packed, const uint32_t* terms,
                                         const __half* residual, int M, int N, int K, int tiles, const __half* fold_w,
                                         __half* fold_xg, float* fold_part, const float* fold_in, float eps) {
    awq::Step<U, GPT> first;
    awq::load_first<U, W, GPT>(packed, terms, blockIdx.x, K, tiles, first);
    pdl_wait();
    pdl_gemv_started();
    awq::gemv_panel<MT, GPT, EPI, U, W, false>(y, x, packed, terms, residual, M, N, K, tiles, fold_w, fold_xg,
                                               fold_part, fold_in, eps, blockIdx.x, blockIdx.y * 8 * MT, first, true,
                                               [](awq::Step<U, GPT>&) { pdl_gemv_streamed(); });
}

// w_hat [N, K] = fp16((q - z) * s): one thread per 16 bytes of w_hat (8 consecutive k of one channel, which
// are the 8 nibbles of one packed word), threads ordered (channel, tile, chunk c of the tile) so that a warp
// stores 512 contiguous bytes of a w_hat row with each instruction. The reads (one word per thread, 64
// contiguous bytes per 16 threads) are a fifth of the bytes. The first version gave each thread a lane's
// 16-byte chunk (32 values): its four 16-byte stores per instruction were 64 bytes apart, half-sector
// writes. Bit-identical to calibrate.awq_pack.dequantize_awq.
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
//  fold_part f32 [M,N/16], fold_in f32 [M,K/16] or null, float eps)
#define FLLAMA_AWQ_GEMV_W(MT, GPT, EPI, U, W, BLOCKS, NAME)                                                \
    extern "C" __global__ void __launch_bounds__(32 * W, BLOCKS) awq_gemv_mt##MT##_g##GPT##_##NAME(        \
        __half* y, const __half* x, const uint32_t* packed, const uint32_t* terms, const __half* residual,  \
        int M, int N, int K, int tiles, const __half* fold_w, __half* fold_xg, float* fold_part,            \
        const float* fold_in, float eps) {                                                                  \
        awq_gemv<MT, GPT, EPI, U, W>(y, x, packed, terms, residual, M, N, K, tiles, fold_w, fold_xg,        \
                                     fold_part, fold_in, eps);                                              \
    }
#define FLLAMA_AWQ_GEMV(MT, GPT, EPI, U, BLOCKS, NAME) FLLAMA_AWQ_GEMV_W(MT, GPT, EPI, U, 4, BLOCKS, NAME)
#define FLLAMA_AWQ_GEMV_EPIS(MT, GPT, U, BLOCKS)                                                 \
    FLLAMA_AWQ_GEMV(MT, GPT, 0, U, BLOCKS, plain) FLLAMA_AWQ_GEMV(MT, GPT, 1, U, BLOCKS, res) \
    FLLAMA_AWQ_GEMV(MT, GPT, 2, U, BLOCKS, silu)
#define FLLAMA_AWQ_GEMV_GROUPS(MT, U) \
    FLLAMA_AWQ_GEMV_EPIS(MT, 1, U, 3) FLLAMA_AWQ_GEMV_EPIS(MT, 2, U, 3) FLLAMA_AWQ_GEMV_EPIS(MT, 4, U, 3)

// U tiles per step (in flight per warp) against resident blocks per SM (BLOCKS, which caps the registers).
// At 8 tokens and groups of 128: U = 2 in four blocks (114 registers) beat U = 4 in three (168) in the engine,
// 525 vs 510 tok/s at batch 1 and 2,944 vs 2,870 at 8 (H200, docs/benchmarks.md step table): the down and
// gate|up GEMVs gain more from the fourth block than q|k|v loses. Groups of 64 / 32 (terms take 4 / 8
// registers per tile): U = 3 / 2 in three blocks (U = 4 spills). 16 / 32 tokens: U = 2 / 1 in three blocks.
FLLAMA_AWQ_GEMV_EPIS(1, 1, 2, 4) FLLAMA_AWQ_GEMV_EPIS(1, 2, 3, 3) FLLAMA_AWQ_GEMV_EPIS(1, 4, 2, 3)
FLLAMA_AWQ_GEMV_GROUPS(2, 2)
FLLAMA_AWQ_GEMV_GROUPS(4, 1)
// W = 8 warps per panel (block 256, two resident: the same 16 warps per SM), 8 tokens, groups of 128, for
// grids of few panels (awq_gemv.py WIDE_WAVES): LLaMA-2-7B's o_proj / down_proj have 256 panels, which at
// 4 warps left every SM with about two blocks, half its warp slots; at 8 each warp streams half the tiles.
FLLAMA_AWQ_GEMV_W(1, 1, 0, 2, 8, 2, plain_w8)
FLLAMA_AWQ_GEMV_W(1, 1, 1, 2, 8, 2, res_w8)
FLLAMA_AWQ_GEMV_W(1, 1, 2, 2, 8, 2, silu_w8)

// (w_hat fp16 [N,K], packed, terms, int N, int K, int tiles); one thread per 16 bytes of w_hat
#define FLLAMA_AWQ_PACKED_DEQUANT(GPT)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) awq_packed_dequant_g##GPT(                           \
        __half* w_hat, const uint32_t* packed, const uint32_t* terms, int N, int K, int tiles) {           \
        awq_packed_dequant<GPT>(w_hat, packed, terms, N, K, tiles);                                         \
    }
FLLAMA_AWQ_PACKED_DEQUANT(1)
FLLAMA_AWQ_PACKED_DEQUANT(2)
FLLAMA_AWQ_PACKED_DEQUANT(4)
