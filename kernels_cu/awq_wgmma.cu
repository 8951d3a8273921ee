// AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a), dequantization fused:
//   y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)  (calibrate.awq_pack's dequantizer)
// then the residual (an fp16 add) or SwiGLU of an interleaved gate|up weight, as awq_gemv.cu's epilogues.
//
// Why: the prefill path writes w_hat (13.5 GB of fp16 for LLaMA-2-7B at every prefill) with
// awq_packed_dequant and multiplies with cuBLAS; the dequantize pass alone takes ~5 ms of a 2048-token
// prefill. Here w_hat only ever exists in shared memory, one 64-k slice at a time. Not yet faster than
// that path (awq_wgmma.py has the numbers), so the engine does not call it.
//
// Block = 128 tokens x 256 channels, two warpgroups of 64 tokens sharing the w_hat tile; 64 k per stage
// (128 bytes of fp16 per row: one row of wgmma.cuh's 128-byte swizzle). Per stage each thread owns one
// channel: cp.async brings its 32 bytes of packed int4 (lanes t, t + 1 of the engine layout: 64 consecutive
// k of the channel) and its group term PREFETCH stages ahead, together with the x tile (4 x 16 bytes per
// thread); when the stage comes up the thread turns its own bytes into 64 w_hat values (8 x 16-byte
// st.shared into row `channel` of the w_hat tile), fences them to the async proxy, and after one barrier
// the warpgroups issue 4 wgmma m64n256k16 (x from the ring, w_hat from its own 3-buffer ring), keeping the
// previous stage's wgmma in flight.
// Buffer reuse, with one barrier per stage: the prefetch after stage kt's barrier overwrites ring slot
// kt - 2, whose wgmma every warpgroup retired (wait_group 1 in stage kt - 1) before that barrier; the w_hat
// written before the barrier goes to buffer kt % 3, last read by wgmma kt - 3, which the other warpgroup
// retired before the barrier of stage kt - 1 that this thread passed.
// Groups of 128 only (one term per channel and 128-k tile); other group sizes keep dequantize + cuBLAS.
// Tails: tokens past M and k past K are zero-filled x (the layout zero-pads the weights to whole tiles);
// channels past N are zero-filled packed words and terms (w_hat 0 * finite = 0); none is stored.
// grid (ceil(M / 128), ceil(N / 256)), tokens fastest (the blocks of a wave share each weight tile).
#include "awq_layout.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BM = 128, BN = 256, BK = 64;  // tokens, channels, k per stage
constexpr int THREADS = 256;
constexpr int STAGES = 4, PREFETCH = 2, WBUF = 3;  // 5 slots fetched 3 ahead measured the same (H200)
constexpr int TILE_WORDS = 256;               // the engine layout's 1 KB panel tile of 128 k (awq_gemv.cu)
constexpr int X_BYTES = BM * SW128_ROW;        // 16 KB
constexpr int RAW_BYTES = BN * 32;             // 8 KB: each channel's two 16-byte lane chunks
constexpr int TERM_BYTES = BN * 4;             // 1 KB
constexpr int RING_BYTES = X_BYTES + RAW_BYTES + TERM_BYTES;  // 25 KB, a multiple of the swizzle period
constexpr int W_BYTES = BN * SW128_ROW;                       // 32 KB
constexpr int SMEM_BYTES = STAGES * RING_BYTES + WBUF * W_BYTES + SW128_ALIGN;
static_assert(RING_BYTES % SW128_ALIGN == 0, "x tiles must stay 1024-byte aligned");
static_assert(PREFETCH + 2 <= STAGES, "a copy may only overwrite the ring slot of the stage two back");

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(ok ? 4 : 0));
}

// d[128] (the warpgroup's 64 tokens x 256 channels, fp32) += x (64 x 16 fp16) * w_hat (256 x 16 fp16)^T.
__device__ __forceinline__ void wgmma_f16_m64n256k16(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " FLLAMA_D128_LIST
                 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : FLLAMA_D128("+f")
                 : "l"(da), "l"(db));
}

// EPI 0: y [M, N];  1: + residual (fp16 add after rounding);  2: y [M, N / 2] = silu(gate) * up of a gate|up
// weight interleaved by 8 (each 16-channel panel: 8 gate channels, then the same 8 up channels).
template <int EPI>
__device__ __forceinline__ void awq_wgmma(__half* __restrict__ y, const __half* __restrict__ x,
                                          const uint32_t* __restrict__ packed, const uint32_t* __restrict__ terms,
                                          const __half* __restrict__ residual, int M, int N, int K, int tiles) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)SMEM_BYTES) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
    unsigned char* wbuf = smem + STAGES * RING_BYTES;
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int stages = (K + BK - 1) / BK;

    // x copies: rows tid / 8 + 32 i, 16-byte chunk tid % 8 (8 k) of the stage's 128 bytes.
    const int c = tid & 7, r0 = tid >> 3;
    const __half* x_src[BM / 32];
    bool x_ok[BM / 32];
#pragma unroll
    for (int i = 0; i < BM / 32; ++i) {
        const int m = m0 + r0 + 32 * i;
        x_ok[i] = m < M;
        x_src[i] = x + (size_t)(x_ok[i] ? m : 0) * K + 8 * c;
    }
    const int x_dst = sw128(r0, c);
    // This thread's channel: its lane chunks (g, t) of rows h of panel n / 16.
    const int n = n0 + tid;
    const bool n_ok = n < N;
    const int nn = n_ok ? n : 0;
    const uint32_t* w_src = packed + ((size_t)(nn >> 4) * tiles * 2 + ((nn >> 3) & 1)) * 128 + (nn & 7) * 16;
    const uint32_t* t_src = terms + (size_t)(nn >> 4) * tiles * 16 + (nn & 7) * 2 + ((nn >> 3) & 1);

    pdl_wait();  // x and the residual come from the previous kernel
    auto load_stage = [&](int kt) {
        unsigned char* ring = smem + (kt % STAGES) * RING_BYTES;
        const int k = kt * BK;
        const bool k_ok = k + 8 * c < K;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < BM / 32; ++i)
            cp_async16(ring + x_dst + 32 * SW128_ROW * i, x_src[i] + (k_ok ? k : 0), x_ok[i] && k_ok);
        // tile kt / 2; lanes t = 2 (kt % 2) and + 1 hold its k's [64 (kt % 2), + 64): 32 contiguous bytes
        const uint32_t* w = w_src + (size_t)(kt >> 1) * TILE_WORDS + (kt & 1) * 8;
        cp_async16(ring + X_BYTES + tid * 32, w, n_ok);
        cp_async16(ring + X_BYTES + tid * 32 + 16, w + 4, n_ok);
        cp_async4(ring + X_BYTES + RAW_BYTES + tid * 4, t_src + (size_t)(kt >> 1) * 16, n_ok);
    };

    float d[128];
    wgmma_pipeline_start<PREFETCH>(d, stages, load_stage);
    for (int kt = 0; kt < stages; ++kt) {
        cp_async_wait<PREFETCH - 1>();  // this thread's copies of stage kt have landed
        {   // its channel's 64 w_hat values of the stage -> row tid of w_hat buffer kt % 3
            const unsigned char* ring = smem + (kt % STAGES) * RING_BYTES;
            const uint4 raw0 = *reinterpret_cast<const uint4*>(ring + X_BYTES + tid * 32);
            const uint4 raw1 = *reinterpret_cast<const uint4*>(ring + X_BYTES + tid * 32 + 16);
            const uint32_t term = *reinterpret_cast<const uint32_t*>(ring + X_BYTES + RAW_BYTES + tid * 4);
            unsigned char* wrow = wbuf + (kt % WBUF) * W_BYTES;
#pragma unroll
            for (int w = 0; w < 4; ++w) {  // lane t's word w holds k 8w .. 8w + 7 of its 32; lane t + 1's follow
#ifdef FLLAMA_AWQ_TIMING_NO_DEQUANT  // timing only (wrong results): the stores without the conversion
                *reinterpret_cast<uint4*>(wrow + sw128(tid, w)) = make_uint4(word(raw0, w), term, 0, 0);
                *reinterpret_cast<uint4*>(wrow + sw128(tid, 4 + w)) = make_uint4(word(raw1, w), term, 0, 0);
#else
                *reinterpret_cast<uint4*>(wrow + sw128(tid, w)) = awq_w_hat8(word(raw0, w), term);
                *reinterpret_cast<uint4*>(wrow + sw128(tid, 4 + w)) = awq_w_hat8(word(raw1, w), term);
#endif
            }
        }
        fence_proxy_async();  // the w_hat stores and the landed x copies, to the tensor cores
        __syncthreads();
        if (kt + PREFETCH < stages) load_stage(kt + PREFETCH);
        cp_async_commit();
        const uint32_t sx = smem_addr + (kt % STAGES) * RING_BYTES + wg * (64 * SW128_ROW);
        const uint32_t sw = smem_addr + STAGES * RING_BYTES + (kt % WBUF) * W_BYTES;
        const uint64_t da = sw128_desc(sx), db = sw128_desc(sw);
        wgmma_stage<BK / 16>(d, da, db, [](auto& acc, uint64_t a, uint64_t b) { wgmma_f16_m64n256k16(acc, a, b); });
    }
    wgmma_drain(d);
    pdl_launch_dependents();

    // Epilogue from the accumulators: rows m, m + 8; column pairs (n, n + 1).
    const int m = m0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + 8 * j + 2 * (lane & 3);
        if (EPI == 2) {
            if ((j & 1) || col >= N) continue;  // j even: gate columns; j + 1: the same f's up columns
            const int f = (n0 + 8 * j) / 2 + 2 * (lane & 3);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (m + 8 * h >= M) continue;
                __half o[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const __half gate = __float2half_rn(d[4 * j + 2 * h + e]);
                    const __half up = __float2half_rn(d[4 * j + 4 + 2 * h + e]);
                    o[e] = __hmul_rn(silu_h(__half2float(gate)), up);
                }
                *reinterpret_cast<__half2*>(y + (size_t)(m + 8 * h) * (N / 2) + f) = __halves2half2(o[0], o[1]);
            }
        } else {
            if (col >= N) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (m + 8 * h >= M) continue;
                const size_t o = (size_t)(m + 8 * h) * N + col;
                __half lo = __float2half_rn(d[4 * j + 2 * h]), hi = __float2half_rn(d[4 * j + 2 * h + 1]);
                if (EPI == 1) {
                    lo = __hadd_rn(lo, residual[o]);
                    hi = __hadd_rn(hi, residual[o + 1]);
                }
                *reinterpret_cast<__half2*>(y + o) = __halves2half2(lo, hi);
            }
        }
    }
}

}  // namespace

// (y fp16, x fp16 [M,K], packed u32 [N/16, tiles, 256], terms u32 [N/16, tiles, 8, 2] (groups of 128),
//  residual fp16 [M,N] or null, M, N, K, tiles); N % 16 == 0, K % 8 == 0.
#define FLLAMA_AWQ_WGMMA(EPI, NAME)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                \
        awq_wgmma_##NAME(__half* y, const __half* x, const uint32_t* packed, const uint32_t* terms,         \
                         const __half* residual, int M, int N, int K, int tiles) {                         \
        awq_wgmma<EPI>(y, x, packed, terms, residual, M, N, K, tiles);                                     \
    }
FLLAMA_AWQ_WGMMA(0, plain)
FLLAMA_AWQ_WGMMA(1, res)
FLLAMA_AWQ_WGMMA(2, silu)
