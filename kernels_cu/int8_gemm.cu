// W8A8 GEMM with the dequant epilogue: y[m, n] = fp16((float(acc) * a_scale[m]) * w_scale[n]) (+ residual),
// acc[m, n] = sum_k q_x[m, k] * qweight[n, k] in exact int32.
//
// int8_gemv_mt{1,2}[_res]: the decode kernel (memory-bound; every weight byte is read once per 8*MT tokens).
//   Block = 8 warps owning 16 output channels; the warps split K and meet in shared memory.
//   Per 64-wide k tile a lane takes 16 bytes of weight row g and of row g + 8 (from the main loop's ring of
//   whole lines in dynamic shared memory, gemm_common.cuh) and 16 bytes of activation
//   row g (per 8-token tile) and feeds two m16n8k32 s8 mma: the weights are the A operand (16 channels),
//   the tokens the B operand (8 tokens), so D = y^T and M <= 8 wastes no weight bandwidth. The lane's 16
//   contiguous bytes are split 8 + 8 over the two mma (a0/a2 = bytes 0-3/4-7 then 8-11/12-15), and the
//   activations are split the same way, which is all the dot product needs.
//   grid (ceil(N / 16), ceil(M / (8 * MT))), block 256.
// int8_gemv_mt{1,2}_silu: the same for the fused gate|up weight, with the SwiGLU and the row maxima for the down
//   projection's deferred quantization in the epilogue (silu_mul_part's work).
// int8_gemv_xq[_res]: the same with x in fp16 plus the partial maxima of each token's row: the block quantizes its
//   rows itself (quantize_fold's work), see XqHook. _res can also write the inputs of the RMSNorm after it
//   deferred (Int8Fold, deferred_quant.cuh). int8_gemv_xq1[_res]: the same for one row, quantized in the main loop
//   (RowQuantX).
// int8_gemv_nq1[_silu]: the plain / SwiGLU GEMV of one row of a deferred RMSNorm, quantized in the main loop from
//   its producer's partials (NormRowHook), with no quantize_fold kernel before it.
// int8_dequant[_res]: the epilogue alone, for the int32 product of torch._int_mm (prefill);
//   4 columns per thread, grid ceil(M * N / 4 / 256), block 256.
#include "deferred_quant.cuh"
#include "norm_fold.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 8;
constexpr int UNROLL = 4;  // 64-wide k tiles per warp step: 16 rows x 256 bytes of weight lines
constexpr int TILE_K = 64;

// The deferred quantization (XQ entries): x arrives in fp16 with each token's row max as C partial maxima that
// its producer wrote (part [M, C]: attention's units, the SwiGLU GEMV's blocks), or with a static amax when part
// is null. After the PDL wait every block quantizes its (at most 8) token rows once into shared memory by
// quantize.cu's rule (quantize_store8); the max of the partial maxima is the row's max exactly, so q and a_scale
// are the bits the quantize kernel would have written, and the kernel that wrote them is gone from the decode
// step. The main loop then reads x from shared memory. Every block redoes the rows (2 K bytes each from L2, all blocks at once), which
// is why the engine uses this for one row only (tuning.defer_quant_max_rows).
struct XqHook {
    int8_t* xs;      // [rows][K] shared
    float* s_inv;    // [8] 127 / amax per row
    float* s_scale;  // [8] a_scale = amax / 127
    float* s_red;    // [8][WARPS]
    const __half* x;
    const float* part;
    const float* static_amax;
    const float* row_amax;  // [M] each row's max |x| itself (the SwiGLU GEMV's atomic max), read instead of part
    int C, m0, rows, K;

    // Every warp of every resident block runs this at once, so its instruction count is what it costs: one
    // row (the batch-1 decode) takes a path without index division or row select.
    __device__ __forceinline__ void operator()() const {
        constexpr int NV = 8, THREADS = 32 * WARPS;
        const int tid = threadIdx.x;
        const int n8 = K / 8, total = rows * n8;  // 8-value chunks of the block's rows
        // chunk c of the block: row c / n8 (0 for one row), column 8 (c % n8)
        auto chunk_row = [&](int c) { return rows == 1 ? 0 : c / n8; };
        auto chunk_off = [&](int c) { return rows == 1 ? (size_t)8 * c : (size_t)(c / n8) * K + 8 * (c % n8); };
        Half8 v[NV];
        // the first pass's values in flight while the maxima are read and reduced
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int c = tid + j * THREADS;
            if (c < total) v[j] = load_half8(x + (size_t)m0 * K + chunk_off(c));
        }
        if (part != nullptr && row_amax == nullptr) {
            // every row's maxima: the block's rows * C partials as one flat range (rows are contiguous in part),
            // up to NV loads per thread in flight at once, each folded into its row's running max (the row is
            // selected in an unrolled loop, so a[] stays in registers)
            float a[8];
#pragma unroll
            for (int r = 0; r < 8; ++r) a[r] = 0.0f;
            const float* p0 = part + (size_t)m0 * C;
            const int P = rows * C;
            for (int base = 0; base < P; base += NV * THREADS) {
                float pv[NV];
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const int i = base + tid + j * THREADS;
                    pv[j] = i < P ? p0[i] : 0.0f;
                }
                if (rows == 1) {  // block-uniform
#pragma unroll
                    for (int j = 0; j < NV; ++j) a[0] = fmaxf(a[0], pv[j]);
                } else {
#pragma unroll
                    for (int j = 0; j < NV; ++j) {
                        const int row = (base + tid + j * THREADS) / C;  // past P: row >= rows, ignored
#pragma unroll
                        for (int r = 0; r < 8; ++r) a[r] = row == r ? fmaxf(a[r], pv[j]) : a[r];
                    }
                }
            }
            warp_rows_max_store<WARPS>(a, rows, s_red);
        }
        __syncthreads();
        if (tid < rows) {
            float amax = 0.0f;
            if (row_amax != nullptr) {
                amax = row_amax[m0 + tid];
            } else if (part != nullptr) {
#pragma unroll
                for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, s_red[tid * WARPS + w]);
            } else {
                amax = *static_amax;
            }
            amax_scales(amax, s_inv[tid], s_scale[tid]);
        }
        __syncthreads();
        const float inv0 = s_inv[0];
        for (int base = 0; base < total; base += NV * THREADS) {
            if (base > 0) {
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const int c = base + tid + j * THREADS;
                    if (c < total) v[j] = load_half8(x + (size_t)m0 * K + chunk_off(c));
                }
            }
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = base + tid + j * THREADS;
                if (c < total) {
                    const float inv = rows == 1 ? inv0 : s_inv[chunk_row(c)];
                    quantize_store8(xs + chunk_off(c), v[j], inv);
                }
            }
        }
        __syncthreads();
    }
};

// The deferred quantization of one row in the main loop (int8_gemv_xq1*, the batch-1 decode step): XqHook makes
// every block read and quantize the whole row into shared memory behind a barrier before its first mma (down_proj:
// 22 KB a block, 256 blocks at once), ~1.2 us of start per GEMV. Here
// XqRowHook (deferred_quant.cuh) only finds the row's max (one L2 read, every warp its own: no barrier), and
// RowQuantX quantizes each tile's x as the loop needs it: the lanes of a warp read one 128-byte run of fp16 x a
// tile (4 bytes each, lane (g, t) values 16 t + 2 g, +1), quantize their two values by quantize.cu's rule (the
// same codes as XqHook) and gather each t's 16 codes with shuffles; the B operand holds the token in column g, so
// lanes g > 0 then keep zeros. The read goes out one step ahead (load), the conversion after that step's math (finish).
struct RowQuantX {
    static constexpr bool LOAD_FIRST = true;  // the first tile's x in flight with the hook's reads
    using Raw = uint32_t;                     // the lane's two fp16 values
    using Value = uint4;
    const int8_t* base;    // x_row's origin: p - base is the element index of the lane's 16-value chunk
    const __half* x;       // the row
    const float* inv;
    int g, t;

    __device__ __forceinline__ uint32_t load(const void* p, bool ok) const {
        const size_t i = static_cast<size_t>(static_cast<const int8_t*>(p) - base) + 2 * g;
        return ok ? __ldg(reinterpret_cast<const unsigned*>(x + i)) : 0u;
    }
    __device__ __forceinline__ uint4 finish(uint32_t r) const {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&r));
        const float s = *inv;
        const uint32_t mine = __byte_perm(quantize_int(f.x, s), quantize_int(f.y, s), 0x0040);  // codes 2g, 2g + 1
        const uint32_t other = __shfl_xor_sync(FULL_MASK, mine, 4);  // lane g ^ 1, same t
        const bool even = (g & 1) == 0;
        const uint32_t word = __byte_perm(even ? mine : other, even ? other : mine, 0x5410);  // codes 4 (g / 2)..+3
        uint4 v;
        v.x = __shfl_sync(FULL_MASK, word, t);  // word j of chunk t: lane g = 2 j
        v.y = __shfl_sync(FULL_MASK, word, 8 + t);
        v.z = __shfl_sync(FULL_MASK, word, 16 + t);
        v.w = __shfl_sync(FULL_MASK, word, 24 + t);
        return g == 0 ? v : make_uint4(0u, 0u, 0u, 0u);
    }
};

// The int8 deferred RMSNorm of one row read by the GEMV after it (int8_gemv_nq1*, the batch-1 decode step's q|k|v
// and gate|up) instead of a quantize_fold kernel in between (a launch and a wait per norm, ~1.3-1.6 us each, 64
// a step): xg fp16 [1, K] = h * w and its C partial maxima mx and sums of h^2
// sq, as an Int8Fold producer wrote them. NormRowHook reduces the partials as quantize_fold does, in its order
// (virtual threads v < 128 sum sq[v], sq[v + 128], ... in turn, then a butterfly per warp of 32, then the four
// warps in order: the same float), so inv and a_scale are quantize_fold's bits, and RowQuantX quantizes xg tile by
// tile with them (deferred_quant.cuh, shared with the fp8 GEMVs). zero (the SwiGLU GEMV's row max of this layer) is
// cleared by block 0.
//
// EPI: 0 plain, 1 + residual, 2 SwiGLU for the down projection's deferred quantization: block b's mma rows g
// are gate channel f = 8b + g (weight row f of the fused [2F, K] gate|up), rows g + 8 the same up channel (row
// F + f), so y [M, F] = fp16(silu(fp16 gate)) * fp16 up (silu_mul.cu's rounding of the two GEMM outputs) and
// part_out [M, F / 8] = max |y| over the block's 8 channels per token; with row_amax (zero before) also each
// token's max |y| itself, an atomic max of the blocks' values (float bits: non-negative floats order as unsigned
// ints, and a max is the same in any order), so that the down projection reads one value per token where the
// F / 8 partials cost each of its blocks an L2 round trip and 5.5 KB. N is F for EPI 2.
// XQ: x16 + part_in / static_amax as above (MT = 1) instead of qx + a_scale; row_amax, when given, is the rows' max.
// XQ_PROLOGUE quantizes up to 8 rows in XqHook, XQ_ROW one row in the main loop (RowQuantX); XQ_NORM one row of
// a deferred RMSNorm (nq) in the main loop, its partials reduced by NormRowHook.
enum XqMode { XQ_NONE = 0, XQ_PROLOGUE = 1, XQ_ROW = 2, XQ_NORM = 3 };
template <int MT, int EPI, int XQ>
__device__ __forceinline__ void int8_gemv(__half* __restrict__ y, float* __restrict__ part_out,
                                          const int8_t* __restrict__ qx, const float* __restrict__ a_scale,
                                          int a_stride, const __half* __restrict__ x16,
                                          const float* __restrict__ part_in, int C, float* row_amax,
                                          const float* __restrict__ static_amax, const int8_t* __restrict__ qweight,
                                          const float* __restrict__ w_scale, const __half* residual,
                                          Int8Fold fold, NormQ nq, int M, int N, int K, int res_early = 0) {
    static_assert(!XQ || MT == 1, "the deferred quantization holds 8 token rows");
    __shared__ int red[WARPS][MT][4][32];
    __shared__ float s_inv[8], s_scale[8], s_red[8 * WARPS];
    // XQ_PROLOGUE: [rows][K]; then the main loop's ring (gemm_common.cuh)
    extern __shared__ __align__(128) int8_t xs[];
    const uint32_t ring_at = XQ == XQ_PROLOGUE ? ((uint32_t)min(M, 8) * K + 127) / 128 * 128 : 0;
    if ((XQ == XQ_ROW || XQ == XQ_NORM) && M != 1) __trap();  // the launcher's rule (int8_gemm.py)
    if (XQ == XQ_NORM) x16 = nq.xg;
    if (dynamic_smem_size() < ring_at + gemv_ring_bytes<WARPS, UNROLL>()) __trap();  // the launcher's shared=
    uint8_t* ring = reinterpret_cast<uint8_t*>(xs) + ring_at;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * 8 * MT;
    const int rows = min(M - m0, 8 * MT);

    // the weight rows of mma rows 0-7 and 8-15
    const int lo_row = EPI == 2 ? blockIdx.x * 8 : blockIdx.x * 16;
    const int hi_row = EPI == 2 ? N + lo_row : lo_row + 8;
    const int n_rows = EPI == 2 ? 2 * N : N;
    bool x_ok[MT];
    const int8_t* x_row[MT];
    if (XQ == XQ_ROW || XQ == XQ_NORM) {  // every lane reads (RowQuantX); x_row only carries the offset k
        x_ok[0] = true;
        x_row[0] = reinterpret_cast<const int8_t*>(x16) + 16 * t;
    } else if (XQ == XQ_PROLOGUE) {
        x_ok[0] = g < rows;
        x_row[0] = xs + (size_t)(x_ok[0] ? g : 0) * K + 16 * t;
    } else {
        token_rows<MT>(qx, M, K, m0, g, 16 * t, x_ok, x_row);
    }

    int acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0;

    // the epilogue's channel (below) and the deferred norm's weight for it: a weight, loaded before the PDL wait
    const int n_epi = blockIdx.x * 16 + (lane >> 2) + ((warp & 2) ? 8 : 0);
    __half fold_w = __float2half_rn(0.0f);
    if (EPI == 1 && fold.xg != nullptr && warp < 4 * MT && n_epi < N) fold_w = fold.w[n_epi];
    // res_early (one token tile): the epilogue thread's residual before the PDL wait (norm_fold.cuh residual_ahead)
    const bool early = EPI == 1 && MT == 1 && res_early != 0;
    const __half rp = early ? __low2half(residual_ahead(residual, false, warp, m0 + 2 * (lane & 3) + (warp & 1), M, N,
                                                        blockIdx.x * 16 + (lane >> 2)))
                            : __float2half_rn(0.0f);

    auto mma = [](auto& c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
        mma_s8_16832(c, a0, a1, a2, a3, b0, b1);
    };
    if constexpr (XQ == XQ_ROW || XQ == XQ_NORM) {
        float inv = 0.0f;  // the row's 127 / amax, which the hook finds and RowQuantX reads
        auto hook = [&] {
            if constexpr (XQ == XQ_ROW) {
                return XqRowHook<Int8Rule>{&inv, s_scale, part_in, static_amax, row_amax, C, m0};
            } else {
                return NormRowHook<Int8Rule>{&inv, s_scale, s_red, nq, K, blockIdx.x == 0};
            }
        };
        gemv_mainloop<WARPS, UNROLL, TILE_K>(qweight, lo_row, hi_row, n_rows, ring, x_row, x_ok, K, 16 * t, warp, M,
                                             acc, mma, hook(),
                                             RowQuantX{reinterpret_cast<const int8_t*>(x16), x16, &inv, g, t});
    } else if constexpr (XQ == XQ_PROLOGUE) {
        gemv_mainloop<WARPS, UNROLL, TILE_K>(
            qweight, lo_row, hi_row, n_rows, ring, x_row, x_ok, K, 16 * t, warp, M, acc, mma,
            XqHook{xs, s_inv, s_scale, s_red, x16, part_in, static_amax, row_amax, C, m0, rows, K}, SharedX{});
    } else {
        gemv_mainloop<WARPS, UNROLL, TILE_K>(qweight, lo_row, hi_row, n_rows, ring, x_row, x_ok, K, 16 * t, warp,
                                             M, acc, mma);
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = acc[mt][r];
    __syncthreads();

    // MT * 128 partial sums per warp; 256 threads take one each (MT <= 2).
    if (threadIdx.x >= MT * 128) return;
    const int mt = threadIdx.x >> 7, r = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
    auto red_sum = [&](int rr) {
        int sum = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += red[w][mt][rr][l];
        return sum;
    };
    const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
    auto scale_of = [&](int mm) { return XQ ? s_scale[mm - m0] : a_scale[(size_t)mm * a_stride]; };
    if (EPI == 2) {  // warps r = 0, 1: gate channel g's sums (rows g) and the matching up sums (rows g + 8)
        if (r >= 2) return;  // warp-uniform
        const int f = blockIdx.x * 8 + (l >> 2);
        float amax = 0.0f;
        if (m < M) {
            const float as = scale_of(m);
            const __half gate = int8_epilogue(red_sum(r), as, w_scale[f], nullptr);
            const __half up = int8_epilogue(red_sum(r + 2), as, w_scale[N + f], nullptr);
            const __half a = __hmul_rn(silu_h(__half2float(gate)), up);
            y[(size_t)m * N + f] = a;
            amax = fabsf(__half2float(a));
        }
        swiglu_amax_store(amax, l, m, M, part_out, blockIdx.x, gridDim.x, row_amax);
        return;
    }
    const int n = n_epi;  // blockIdx.x * 16 + (l >> 2) + (r >= 2 ? 8 : 0): this thread is lane l of warp r
    float sq = 0.0f, mx = 0.0f;
    if (n < N && m < M) {
        const size_t o = (size_t)m * N + n;
        const __half h = early ? __hadd_rn(int8_epilogue(red_sum(r), scale_of(m), w_scale[n], nullptr), rp)
                               : int8_epilogue(red_sum(r), scale_of(m), w_scale[n], EPI == 1 ? residual + o : nullptr);
        y[o] = h;
        if (EPI == 1 && fold.xg != nullptr) fold8_values(fold, h, fold_w, o, sq, mx);
    }
    if (EPI == 1 && fold.xg != nullptr) fold8_store(fold, sq, mx, l, m, M, n, N);  // block-uniform
}

template <bool RESIDUAL>
__device__ __forceinline__ void int8_dequant(__half* __restrict__ y, const int* __restrict__ acc,
                                             const float* __restrict__ a_scale, int a_stride,
                                             const float* __restrict__ w_scale,
                                             const __half* __restrict__ residual, int M, int N) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;  // N % 4 == 0
    if (i >= (size_t)M * N) return;
    const int m = (int)(i / N), n = (int)(i % N);
    const int4 a = *reinterpret_cast<const int4*>(acc + i);
    const float4 ws = *reinterpret_cast<const float4*>(w_scale + n);
    const float as = a_scale[(size_t)m * a_stride];
    __half h[4];
    h[0] = int8_epilogue(a.x, as, ws.x, RESIDUAL ? residual + i : nullptr);
    h[1] = int8_epilogue(a.y, as, ws.y, RESIDUAL ? residual + i + 1 : nullptr);
    h[2] = int8_epilogue(a.z, as, ws.z, RESIDUAL ? residual + i + 2 : nullptr);
    h[3] = int8_epilogue(a.w, as, ws.w, RESIDUAL ? residual + i + 3 : nullptr);
    *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(h);
}

}  // namespace

// Arguments of the plain gemv entries: (y fp16 [M,N], q_x int8 [M,K], a_scale f32 [M or 1], int a_stride (1 or 0),
//   qweight int8 [N,K], w_scale f32 [N], residual fp16 [M,N] or null, fold_w, fold_xg, fold_sq, fold_mx (the next
//   norm deferred, as the XQ entries'; with the residual only), int M, int N, int K)
#define FLLAMA_INT8_GEMV(NAME, MT, EPI)                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        NAME(__half* y, const int8_t* qx, const float* a_scale, int a_stride, const int8_t* qweight,                  \
             const float* w_scale, const __half* residual, const __half* fold_w, __half* fold_xg,                     \
             float* fold_sq, float* fold_mx, int M, int N, int K) {                                                   \
        int8_gemv<MT, EPI, XQ_NONE>(y, nullptr, qx, a_scale, a_stride, nullptr, nullptr, 0, nullptr, nullptr,         \
                                    qweight, w_scale, residual, Int8Fold{fold_w, fold_xg, fold_sq, fold_mx},          \
                                    NormQ{}, M, N, K);                                                                \
    }

FLLAMA_INT8_GEMV(int8_gemv_mt1, 1, 0)
FLLAMA_INT8_GEMV(int8_gemv_mt2, 2, 0)
FLLAMA_INT8_GEMV(int8_gemv_mt1_res, 1, 1)
FLLAMA_INT8_GEMV(int8_gemv_mt2_res, 2, 1)

// SwiGLU entries: (y fp16 [M,F], part f32 [M,F/8], row_amax f32 [M] (zero) or null, q_x int8 [M,K], a_scale,
//   int a_stride, qweight int8 [2F,K] (gate rows, then up rows), w_scale f32 [2F], int M, int F, int K);
//   grid (F / 8, ceil(M / (8 MT))), block 256.
#define FLLAMA_INT8_GEMV_SILU(NAME, MT)                                                                               \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        NAME(__half* y, float* part, float* row_amax, const int8_t* qx, const float* a_scale, int a_stride,           \
             const int8_t* qweight, const float* w_scale, int M, int F, int K) {                                      \
        int8_gemv<MT, 2, XQ_NONE>(y, part, qx, a_scale, a_stride, nullptr, nullptr, 0, row_amax, nullptr,             \
                                  qweight, w_scale, nullptr, Int8Fold{}, NormQ{}, M, F, K);                           \
    }
FLLAMA_INT8_GEMV_SILU(int8_gemv_mt1_silu, 1)
FLLAMA_INT8_GEMV_SILU(int8_gemv_mt2_silu, 2)

// Deferred-quantization entries: (y fp16 [M,N], x fp16 [M,K], part f32 [M,C] or null, int C, row_amax f32 [M] or
//   null (the rows' max itself, read instead of part), static_amax f32 [1] (with both null), qweight, w_scale,
//   residual or null, fold_w fp16 [N] or null, fold_xg fp16 [M,N], fold_sq
//   f32 [M,N/8], fold_mx f32 [M,N/8] (the next norm deferred, with the residual only), int M, int N, int K,
//   int res_early (the residual read before the PDL wait, its writer two kernels back: int8_gemm.py));
//   M <= 8 per grid row; dynamic shared memory: min(M, 8) * K bytes rounded up to 128, then the main loop's ring
//   (gemm_shapes.gemv_xq_shared).
#define FLLAMA_INT8_GEMV_XQ(NAME, EPI, MODE)                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        NAME(__half* y, const __half* x, const float* part, int C, const float* row_amax,                             \
             const float* static_amax, const int8_t* qweight, const float* w_scale, const __half* residual,           \
             const __half* fold_w, __half* fold_xg, float* fold_sq, float* fold_mx, int M, int N, int K,              \
             int res_early) {                                                                                         \
        int8_gemv<1, EPI, MODE>(y, nullptr, nullptr, nullptr, 0, x, part, C, const_cast<float*>(row_amax),            \
                                static_amax, qweight, w_scale, residual,                                              \
                                Int8Fold{fold_w, fold_xg, fold_sq, fold_mx}, NormQ{}, M, N, K, res_early);            \
    }
FLLAMA_INT8_GEMV_XQ(int8_gemv_xq, 0, XQ_PROLOGUE)
FLLAMA_INT8_GEMV_XQ(int8_gemv_xq_res, 1, XQ_PROLOGUE)
// the same for one row (M == 1), quantized in the main loop; no shared memory beyond the ring
FLLAMA_INT8_GEMV_XQ(int8_gemv_xq1, 0, XQ_ROW)
FLLAMA_INT8_GEMV_XQ(int8_gemv_xq1_res, 1, XQ_ROW)

// One row of a deferred RMSNorm, quantized in the main loop (NormQ): (y fp16 [1,N or F], part f32 [1,F/8] (SwiGLU),
//   row_amax f32 [1] or null (SwiGLU), xg fp16 [1,K], mx f32 [1,C], sq f32 [1,C] or null, static_amax f32 [1] or
//   null, float eps, int C, zero f32 [1] or null, qweight, w_scale, int M (1), int N (F for the SwiGLU), int K);
//   grid as int8_gemv_mt1 / _mt1_silu, dynamic shared memory the ring.
#define FLLAMA_INT8_GEMV_NQ(NAME, EPI)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        NAME(__half* y, float* part, float* row_amax, const __half* xg, const float* mx, const float* sq,             \
             const float* static_amax, float eps, int C, float* zero, const int8_t* qweight,                          \
             const float* w_scale, int M, int N, int K) {                                                             \
        int8_gemv<1, EPI, XQ_NORM>(y, part, nullptr, nullptr, 0, nullptr, nullptr, 0, row_amax, nullptr,              \
                                   qweight, w_scale, nullptr, Int8Fold{},                                             \
                                   NormQ{xg, mx, sq, static_amax, zero, eps, C}, M, N, K);                            \
    }
FLLAMA_INT8_GEMV_NQ(int8_gemv_nq1, 0)
FLLAMA_INT8_GEMV_NQ(int8_gemv_nq1_silu, 2)

// (y fp16 [M,N], acc int32 [M,N], a_scale f32 [M or 1], int a_stride, w_scale f32 [N], residual or null, M, N)
#define FLLAMA_INT8_DEQUANT(NAME, RES)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                                 \
        NAME(__half* y, const int* acc, const float* a_scale, int a_stride, const float* w_scale,                     \
             const __half* residual, int M, int N) {                                                                  \
        pdl_enter();                                                                                                  \
        int8_dequant<RES>(y, acc, a_scale, a_stride, w_scale, residual, M, N);                                        \
    }

FLLAMA_INT8_DEQUANT(int8_dequant, false)
FLLAMA_INT8_DEQUANT(int8_dequant_res, true)
