// W8A8 prefill GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a) with the dequant epilogue fused:
//   y[m, n] = fp16((float(acc) * a_scale[m]) * w_scale[n])  (+ residual[m, n]),  acc = sum_k q_x[m, k] w[n, k]
// the same two roundings as int8_gemm.cu's epilogue, so the result is bit for bit the torch._int_mm path's.
//
// Why: torch._int_mm runs a cuBLASLt sm80 int8 kernel on Hopper (232 us for a 2048 x 4096 x 11008 GEMM,
// against 197 us for cuBLAS's fp16 sm90 kernel) and writes the int32 product to memory for a second
// kernel to scale: ~0.9 GB of int32 traffic per layer at 2048 tokens. wgmma's int8 rate is twice its fp16
// rate, and the scales are applied to the accumulators in registers.
//
// Block = 128 tokens x 256 channels, 256 threads = two warpgroups of 64 tokens each sharing the weight
// tile. K advances 128 bytes per stage; a stage is the x tile (128 rows x 128 B) and the weight tile (256
// rows x 128 B), both K-major (as wgmma needs for 8-bit operands) in the 128-byte swizzle: the 16-byte
// chunk c of row r is stored at chunk c ^ (r % 8), so cp.async writes and wgmma reads are conflict-free.
// Tiles are 1024-byte aligned (the swizzle pattern repeats every 8 rows); a wgmma descriptor walks K by
// advancing its start address 32 bytes per k32 step.
// Pipeline (STAGES = 4 buffers): every thread copies its share of the tile PREFETCH = 2 ahead with
// cp.async, waits for the current tile, and the warpgroups issue 4 wgmma m64n256k32 on it, keeping the
// previous tile's wgmma in flight (wait_group 1). The buffer a copy overwrites last fed the wgmma two
// tiles back, which every warpgroup has retired before the barrier that precedes the copy.
// Tails: rows past M or N and k's past K are zero-filled by cp.async (src-size 0), never stored.
// grid (ceil(M / 128), ceil(N / 256)): tokens fastest, so the blocks of one wave share each weight tile
// (read once from DRAM) and the activations (M x K bytes) stay in L2. Dynamic shared memory SMEM_BYTES.
#include "common.cuh"
#include "gemm_common.cuh"

using namespace fllama;

namespace {

constexpr int BM = 128, BN = 256, BK = 128;  // tokens, channels, k bytes per stage
constexpr int THREADS = 256;
constexpr int STAGES = 4, PREFETCH = 2;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // 16 KB + 32 KB per stage
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int ALIGN = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 B
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + ALIGN;  // the launcher's dynamic shared memory
static_assert(PREFETCH + 2 <= STAGES, "a copy may only overwrite the buffer of the tile two back");

// wgmma shared-memory matrix descriptor for a K-major tile in the 128-byte swizzle: start address >> 4 (bits
// 0-13), leading-dimension offset (unused for this layout: 1), stride between 8-row groups 1024 B (bits
// 32-45), swizzle mode 1 = 128 B (bits 62-63).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulators in their registers across the asynchronous wgmma (no compiler copies of them
// between issue and wait, which would make ptxas serialize the wgmma: warning C7514).
__device__ __forceinline__ void fence_operands(int (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define FLLAMA_D4(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3])
#define FLLAMA_D16(i) FLLAMA_D4(i), FLLAMA_D4(i + 4), FLLAMA_D4(i + 8), FLLAMA_D4(i + 12)
#define FLLAMA_D64(i) FLLAMA_D16(i), FLLAMA_D16(i + 16), FLLAMA_D16(i + 32), FLLAMA_D16(i + 48)

// d[128] (this thread's share of the 64 x 256 int32 tile) += A (64 x 32 s8) * B (256 x 32 s8)^T.
// Fragment of d: d[4j + {0,1}] = (row 16 warp + lane / 4, cols 8j + 2 (lane % 4) + {0,1}), d[4j + {2,3}] the
// same 8 rows further (warp = warp index inside the warpgroup).
__device__ __forceinline__ void wgmma_s8_m64n256k32(int (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p;\n}\n"
        : FLLAMA_D64(0), FLLAMA_D64(64)
        : "l"(da), "l"(db));
}

template <bool RESIDUAL>
__device__ __forceinline__ void int8_wgmma(__half* __restrict__ y, const int8_t* __restrict__ qx,
                                           const float* __restrict__ a_scale, int a_stride,
                                           const int8_t* __restrict__ qweight, const float* __restrict__ w_scale,
                                           const __half* __restrict__ residual, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)SMEM_BYTES) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = smem_raw + ((ALIGN - ((uint32_t)__cvta_generic_to_shared(smem_raw) & (ALIGN - 1))) & (ALIGN - 1));
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int tiles = (K + BK - 1) / BK;

    // This thread's copies per stage: rows tid / 8 + 32 i of x (4) and of the weight (8), 16-byte chunk tid % 8.
    const int c = tid & 7, r0 = tid >> 3;
    const int8_t* a_src[BM / 32];
    const int8_t* b_src[BN / 32];
    bool a_ok[BM / 32], b_ok[BN / 32];
#pragma unroll
    for (int i = 0; i < BM / 32; ++i) {
        const int m = m0 + r0 + 32 * i;
        a_ok[i] = m < M;
        a_src[i] = qx + (size_t)(a_ok[i] ? m : 0) * K + 16 * c;
    }
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
        const int n = n0 + r0 + 32 * i;
        b_ok[i] = n < N;
        b_src[i] = qweight + (size_t)(b_ok[i] ? n : 0) * K + 16 * c;
    }
    const int dst = r0 * BK + ((c ^ (r0 & 7)) << 4);  // rows r0 + 32 i keep r0's swizzle (32 % 8 == 0)

    pdl_wait();  // x (and the residual) come from the previous kernel
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

    int d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0;

#pragma unroll
    for (int kt = 0; kt < PREFETCH; ++kt) {
        if (kt < tiles) load_tile(kt);
        cp_async_commit();  // always commit: the wait below counts groups
    }
    for (int kt = 0; kt < tiles; ++kt) {
        cp_async_wait<PREFETCH - 1>();  // this thread's copies of tile kt have landed
        fence_proxy_async();            // ... and are visible to the tensor cores (async proxy)
        __syncthreads();                // everyone's copies; every warpgroup has retired tile kt - 2's wgmma
        if (kt + PREFETCH < tiles) load_tile(kt + PREFETCH);
        cp_async_commit();
        const uint32_t sa = smem_addr + (kt % STAGES) * STAGE_BYTES + wg * (64 * BK);
        const uint32_t sb = smem_addr + (kt % STAGES) * STAGE_BYTES + A_BYTES;
        const uint64_t da = smem_desc(sa), db = smem_desc(sb);
        fence_operands(d);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) wgmma_s8_m64n256k32(d, da + 2 * ks, db + 2 * ks);  // +32 B
        wgmma_commit();
        fence_operands(d);
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_operands(d);
    pdl_launch_dependents();

    // Epilogue straight from the accumulators: rows m, m + 8; column pairs (n, n + 1), N % 8 == 0.
    const int m = m0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
    const float as0 = m < M ? a_scale[(size_t)m * a_stride] : 0.0f;
    const float as1 = m + 8 < M ? a_scale[(size_t)(m + 8) * a_stride] : 0.0f;
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
            const __half lo = int8_epilogue(d[4 * j + 2 * h], as, ws.x, RESIDUAL ? residual + o : nullptr);
            const __half hi = int8_epilogue(d[4 * j + 2 * h + 1], as, ws.y, RESIDUAL ? residual + o + 1 : nullptr);
            *reinterpret_cast<__half2*>(y + o) = __halves2half2(lo, hi);
        }
    }
}

}  // namespace

// (y fp16 [M,N], q_x s8 [M,K], a_scale f32 [M] or [1], a_stride 1|0, qweight s8 [N,K], w_scale f32 [N],
//  residual fp16 [M,N] or null, M, N, K); K % 16 == 0, N % 8 == 0.
#define FLLAMA_INT8_WGMMA(RES, NAME)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                 \
        int8_wgmma##NAME(__half* y, const int8_t* qx, const float* a_scale, int a_stride, const int8_t* qw,  \
                         const float* w_scale, const __half* residual, int M, int N, int K) {                \
        int8_wgmma<RES>(y, qx, a_scale, a_stride, qw, w_scale, residual, M, N, K);                          \
    }
FLLAMA_INT8_WGMMA(false, )
FLLAMA_INT8_WGMMA(true, _res)
