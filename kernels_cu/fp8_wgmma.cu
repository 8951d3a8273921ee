// FP8 E4M3 W8A8 prefill GEMM on Hopper's warpgroup tensor cores (wgmma e4m3, sm_90a), the scales in the epilogue:
//   y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])  (+ residual[m, n]),  acc = sum_k x8[m, k] w8[n, k] in fp32
// (model_zoo/quant/fp8.py's contract; fp8_common.cuh's epilogue). wgmma's e4m3 rate is twice its fp16 rate.
//
// Two-level accumulation: Hopper's e4m3 wgmma adds into its accumulator keeping only ~14 bits of the fp32
// mantissa (truncated; DeepSeek-V3 report 3.3.2), which over K = 4096-11008 drifts the sums by up to 1% (K / 32
// truncating adds, all the same way). So each stage's 128 k's are summed by the tensor cores from zero (scale-d 0
// on the first of its 4 wgmma) into a chunk accumulator, and the chunk is added into the fp32 accumulator acc by
// ordinary fp32 adds once wgmma.wait_group has retired it (CUTLASS's FP8 accumulation without "fast accumulation").
//
// Block = 128 tokens x 256 channels, 256 threads = two warpgroups of 64 tokens each sharing the weight tile. K
// advances 128 codes per stage; a stage is the x tile (128 rows x 128 B) and the weight tile (256 rows x 128 B),
// both K-major (as wgmma needs for 8-bit operands) in the 128-byte swizzle (wgmma.cuh). acc keeps the warpgroup's
// 64 x 256 tile (128 registers a thread); the chunk holds one 128-channel half (m64n128, 64 registers: two of the
// full width would not fit 255), so a stage is two rounds of 4 wgmma m64n128k32 + wait + 64 adds. The two
// warpgroups' rounds interleave on the tensor cores while the other adds.
// Pipeline (STAGES = 4 buffers): every thread copies its share of the tile PREFETCH = 3 ahead with cp.async,
// waits for the current tile, and the warpgroups run the stage to completion (wait_group 0 before the chunk is
// read). The buffer a copy overwrites last fed tile kt - 1, which every warpgroup retired before the barrier
// that precedes the copy.
// Tails: rows past M or N and k's past K are zero-filled by cp.async (src-size 0), never stored.
// fp8_wgmma_silu: a gate|up weight interleaved by 8 (swiglu_layout.py), so a thread's columns 8j + c (gate, j even)
// and 8 (j + 1) + c (the same up channel) meet in its registers: y [M, N / 2] = fp16(silu(fp16 gate)) * fp16 up.
// grid (ceil(M / 128), ceil(N / 256)): tokens fastest, so the blocks of one wave share each weight tile (read once
// from DRAM) and the activations (M x K bytes) stay in L2. Dynamic shared memory SMEM_BYTES.
#include "fp8_common.cuh"
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BM = 128, BN = 256, BK = 128;  // tokens, channels, k codes per stage
constexpr int THREADS = 256;
constexpr int STAGES = 4, PREFETCH = 3;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // 16 KB + 32 KB per stage
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + SW128_ALIGN;  // the launcher's dynamic shared memory
static_assert(PREFETCH + 1 <= STAGES, "a copy may only overwrite the buffer of the tile one back (retired)");
constexpr int HALF = BN / 2;  // channels of one chunk round (wgmma n128)

// The 64 accumulator operands of an m64n128 wgmma (FLLAMA_D64 names them d[0..63]).
#define FP8_D64_LIST                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d[64] (this thread's share of the warpgroup's 64 x 128 fp32 chunk) = (ADD ? d : 0) + A (64 x 32 e4m3) *
// B (128 x 32 e4m3)^T; m64n128's d[4j + r] are m64n256's d[4j + r] of the tile's first 128 columns (wgmma.cuh).
template <int ADD>
__device__ __forceinline__ void wgmma_e4m3_m64n128k32(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FP8_D64_LIST ", %64, %65, p, 1, 1;\n}\n"
                 : FLLAMA_D64("+f", 0)
                 : "l"(da), "l"(db), "n"(ADD));
}

// Pins the chunk in its registers across the asynchronous wgmma (wgmma.cuh's fence_operands, 64 wide).
__device__ __forceinline__ void fence_chunk(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One chunk round of a warpgroup: channels 128 h.. of the stage's 128 k's summed by the tensor cores from zero,
// retired, then added into acc in fp32 (acc[64 h + i] is the chunk's d[i]: the m64n256 layout).
template <int H>
__device__ __forceinline__ void chunk_round(float (&acc)[128], float (&d)[64], uint64_t da, uint64_t db) {
    fence_chunk(d);
    wgmma_fence();
    wgmma_e4m3_m64n128k32<0>(d, da, db);
#pragma unroll
    for (int ks = 1; ks < BK / 32; ++ks) wgmma_e4m3_m64n128k32<1>(d, da + 2 * ks, db + 2 * ks);  // +32 B a step
    wgmma_commit();
    wgmma_wait<0>();
    fence_chunk(d);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[64 * H + i] = __fadd_rn(acc[64 * H + i], d[i]);
}

enum Epi { EPI_PLAIN = 0, EPI_RES = 1, EPI_SILU = 2 };

template <int EPI>
__device__ __forceinline__ void fp8_wgmma(__half* __restrict__ y, const uint8_t* __restrict__ x8,
                                          const float* __restrict__ a_scale, int a_stride,
                                          const uint8_t* __restrict__ w8, const float* __restrict__ w_scale,
                                          const __half* residual, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)SMEM_BYTES) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int tiles = (K + BK - 1) / BK;

    // This thread's copies per stage: rows tid / 8 + 32 i of x (4) and of the weight (8), 16-byte chunk tid % 8.
    const int c = tid & 7, r0 = tid >> 3;
    const uint8_t* a_src[BM / 32];
    const uint8_t* b_src[BN / 32];
    bool a_ok[BM / 32], b_ok[BN / 32];
#pragma unroll
    for (int i = 0; i < BM / 32; ++i) {
        const int m = m0 + r0 + 32 * i;
        a_ok[i] = m < M;
        a_src[i] = x8 + (size_t)(a_ok[i] ? m : 0) * K + 16 * c;
    }
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
        const int n = n0 + r0 + 32 * i;
        b_ok[i] = n < N;
        b_src[i] = w8 + (size_t)(b_ok[i] ? n : 0) * K + 16 * c;
    }
    const int dst = sw128(r0, c);  // rows r0 + 32 i keep r0's swizzle (32 % 8 == 0)

    pdl_wait();  // x8 and a_scale (and the residual) come from the previous kernels
    auto load_tile = [&](int kt) {
        unsigned char* sa = smem + (kt % STAGES) * STAGE_BYTES;
        unsigned char* sb = sa + A_BYTES;
        const int k = kt * BK;
        const bool k_ok = k + 16 * c < K;  // K % 16 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < BM / 32; ++i) cp_async16(sa + dst + 32 * BK * i, a_src[i] + (k_ok ? k : 0), a_ok[i] && k_ok);
#pragma unroll
        for (int i = 0; i < BN / 32; ++i) cp_async16(sb + dst + 32 * BK * i, b_src[i] + (k_ok ? k : 0), b_ok[i] && k_ok);
    };

    float d[128];  // acc: the fp32 sums (the epilogue's d)
    float chunk[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) chunk[i] = 0.0f;  // (scale-d 0 ignores it; defined for the compiler)
    wgmma_pipeline_start<PREFETCH>(d, tiles, load_tile);
    for (int kt = 0; kt < tiles; ++kt) {
        cp_async_wait<PREFETCH - 1>();  // this thread's copies of tile kt have landed
        fence_proxy_async();            // ... and are visible to the tensor cores (async proxy)
        __syncthreads();                // everyone's copies; every warpgroup has retired tile kt - 1's wgmma
        if (kt + PREFETCH < tiles) load_tile(kt + PREFETCH);
        cp_async_commit();
        const uint32_t sa = smem_addr + (kt % STAGES) * STAGE_BYTES + wg * (64 * BK);
        const uint32_t sb = smem_addr + (kt % STAGES) * STAGE_BYTES + A_BYTES;
        const uint64_t da = sw128_desc(sa);
        chunk_round<0>(d, chunk, da, sw128_desc(sb));
        chunk_round<1>(d, chunk, da, sw128_desc(sb + HALF * BK));  // weight rows 128..: 1024-byte aligned
    }
    pdl_launch_dependents();

    // Epilogue straight from the accumulators: rows m, m + 8; column pairs (n, n + 1) of 8-column group j.
    const int m = m0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
    const float as0 = m < M ? a_scale[(size_t)m * a_stride] : 0.0f;
    const float as1 = m + 8 < M ? a_scale[(size_t)(m + 8) * a_stride] : 0.0f;
    if constexpr (EPI == EPI_SILU) {  // N % 16 == 0: a panel (gate group j, up group j + 1) is all in or out
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
            const int n = n0 + 8 * j + 2 * (lane & 3);
            if (n >= N) continue;
            const float2 wg_ = *reinterpret_cast<const float2*>(w_scale + n);
            const float2 wu = *reinterpret_cast<const float2*>(w_scale + n + 8);
            const int f = (n0 + 8 * j) / 2 + 2 * (lane & 3);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int mm = m + 8 * h;
                if (mm >= M) continue;
                const float as = h ? as1 : as0;
                const __half g0 = fp8_epilogue(d[4 * j + 2 * h], as, wg_.x, nullptr);
                const __half g1 = fp8_epilogue(d[4 * j + 2 * h + 1], as, wg_.y, nullptr);
                const __half u0 = fp8_epilogue(d[4 * (j + 1) + 2 * h], as, wu.x, nullptr);
                const __half u1 = fp8_epilogue(d[4 * (j + 1) + 2 * h + 1], as, wu.y, nullptr);
                const __half lo = __hmul_rn(silu_h(__half2float(g0)), u0);
                const __half hi = __hmul_rn(silu_h(__half2float(g1)), u1);
                *reinterpret_cast<__half2*>(y + (size_t)mm * (N / 2) + f) = __halves2half2(lo, hi);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = n0 + 8 * j + 2 * (lane & 3);
            if (n >= N) continue;
            const float2 ws = *reinterpret_cast<const float2*>(w_scale + n);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int mm = m + 8 * h;
                if (mm >= M) continue;
                const size_t o = (size_t)mm * N + n;
                const float as = h ? as1 : as0;
                const bool res = EPI == EPI_RES;
                const __half lo = fp8_epilogue(d[4 * j + 2 * h], as, ws.x, res ? residual + o : nullptr);
                const __half hi = fp8_epilogue(d[4 * j + 2 * h + 1], as, ws.y, res ? residual + o + 1 : nullptr);
                *reinterpret_cast<__half2*>(y + o) = __halves2half2(lo, hi);
            }
        }
    }
}

}  // namespace

// (y fp16 [M,N] (silu: [M,N/2]), x8 e4m3 [M,K], a_scale f32 [M] or [1], a_stride 1|0, w8 e4m3 [N,K],
//  w_scale f32 [N], residual fp16 [M,N] or null, M, N, K); K % 16 == 0, N % 8 == 0 (silu: N % 16 == 0).
#define FLLAMA_FP8_WGMMA(EPI, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                 \
        fp8_wgmma_##NAME(__half* y, const uint8_t* x8, const float* a_scale, int a_stride, const uint8_t* w8, \
                         const float* w_scale, const __half* residual, int M, int N, int K) {                \
        fp8_wgmma<EPI>(y, x8, a_scale, a_stride, w8, w_scale, residual, M, N, K);                            \
    }
FLLAMA_FP8_WGMMA(EPI_PLAIN, plain)
FLLAMA_FP8_WGMMA(EPI_RES, res)
FLLAMA_FP8_WGMMA(EPI_SILU, silu)
