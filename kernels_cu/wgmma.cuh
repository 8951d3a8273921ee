// Hopper warpgroup MMA (wgmma, sm_90a) helpers of the prefill GEMMs (int8_wgmma.cu, fp8_wgmma.cu, awq_wgmma.cu).
//
// Shared-memory operands are K-major tiles of 128-byte rows in the 128-byte swizzle: the 16-byte chunk c of
// row r is stored at chunk c ^ (r % 8), so that cp.async / st.shared writes of 8 consecutive rows and the
// tensor cores' reads are both free of bank conflicts. Tiles start 1024-byte aligned (the pattern repeats
// every 8 rows); a descriptor steps along K by advancing its start address (32 bytes per k32 of int8 or
// k16 of fp16).
// Accumulators: a warpgroup's m64n256 tile is 128 registers per thread; d[4j + {0,1}] = (row 16 w + lane / 4,
// cols 8j + 2 (lane % 4) + {0,1}), d[4j + {2,3}] the same 8 rows further (w = warp index in the warpgroup).
#pragma once

#include <stdint.h>

#include "gemm_common.cuh"

namespace fllama {

constexpr int SW128_ROW = 128;     // bytes per swizzled row
constexpr int SW128_ALIGN = 1024;  // 8 rows: the swizzle period

// Byte offset of 16-byte chunk c (0-7) of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ int sw128(int r, int c) { return r * SW128_ROW + ((c ^ (r & 7)) << 4); }

// Descriptor of a K-major 128-byte-swizzled tile: start address >> 4 (bits 0-13), leading-dimension offset
// (unused by this layout: 1), 1024 bytes between 8-row groups (bits 32-45), swizzle mode 1 = 128 B (62-63).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
    return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// The dynamic shared memory rounded up to the swizzle period.
__device__ __forceinline__ unsigned char* sw128_base(unsigned char* smem_raw) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem_raw);
    return smem_raw + ((SW128_ALIGN - (a & (SW128_ALIGN - 1))) & (SW128_ALIGN - 1));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {  // at most N committed groups of this warpgroup still running
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the tensor cores' async proxy;
// each writing thread fences before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins the accumulators in their registers across the asynchronous wgmma: without it the compiler may copy
// them between issue and wait, and ptxas then serializes every wgmma (warning C7514).
__device__ __forceinline__ void fence_operands(int (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
template <int N>  // any fp32 accumulator set (the decode GEMMs' m64n32 / m64n64 tiles too)
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// TMA (the bulk tensor copy engine): the box at (c0, r0) of a 2D tensor map (in global memory) into shared memory
// at dst, completing its bytes on the mbarrier bar, whose phase mbar_expect_tx announced them. The 128-byte swizzle of
// a map made with it matches sw128's layout (dst 1024-byte aligned).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, uint32_t bar, int c0, int r0) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(map), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
}

// Barrier of a subset of the block (ids 1-15; 0 is __syncthreads), e.g. one warpgroup's 128 threads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Position in a ring of N slots guarded by mbarriers: the slot and the parity of its barriers' current phase
// (flipped at each wrap), as CUTLASS's PipelineState; cheaper than kt % N and kt / N for N not a power of 2.
template <int N>
struct RingPos {
    int slot = 0;
    uint32_t phase = 0;
    __device__ __forceinline__ void next() {
        if (++slot == N) {
            slot = 0;
            phase ^= 1;
        }
    }
};

// Pipeline start: the accumulators zeroed and the copies of the first PREFETCH stages issued by load(kt), one
// cp.async group per stage, committed even past the last stage so that the main loop's waits count groups.
template <int PREFETCH, typename T, typename Load>
__device__ __forceinline__ void wgmma_pipeline_start(T (&d)[128], int stages, Load load) {
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = T(0);
#pragma unroll
    for (int kt = 0; kt < PREFETCH; ++kt) {
        if (kt < stages) load(kt);
        cp_async_commit();
    }
}

// One pipeline stage's tensor-core work of a warpgroup: KSTEPS wgmma (mma(d, da, db)) down the stage's K,
// each descriptor advanced 32 bytes per step, committed as one group; then wait until at most this group is
// still running, so the previous stage's buffers are free once every warpgroup has passed a barrier.
template <int KSTEPS, typename T, typename Mma>
__device__ __forceinline__ void wgmma_stage(T (&d)[128], uint64_t da, uint64_t db, Mma mma) {
    fence_operands(d);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) mma(d, da + 2 * ks, db + 2 * ks);
    wgmma_commit();
    fence_operands(d);
    wgmma_wait<1>();
}

// After the last stage: every group retired, the accumulators readable.
template <typename T>
__device__ __forceinline__ void wgmma_drain(T (&d)[128]) {
    wgmma_wait<0>();
    fence_operands(d);
}

// The prefill GEMMs' plain / residual epilogue straight from a warpgroup's m64n(BN) accumulators d (any type):
// this thread's rows m and m + 8, column pairs (n, n + 1) of each 8-column group j; y = out(acc, a_scale of the
// row, w_scale[n], the residual element or null), stored as fp16 pairs. Rows past M and columns past N are skipped.
template <int BN, bool RESIDUAL, typename T, typename Out>
__device__ __forceinline__ void wgmma_store_rows(const T (&d)[BN / 2], __half* y, const float* __restrict__ a_scale,
                                                 int a_stride, const float* __restrict__ w_scale,
                                                 const __half* residual, int M, int N, int m, int n0, int lane,
                                                 Out out) {
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
            const __half lo = out(d[4 * j + 2 * h], as, ws.x, RESIDUAL ? residual + o : nullptr);
            const __half hi = out(d[4 * j + 2 * h + 1], as, ws.y, RESIDUAL ? residual + o + 1 : nullptr);
            *reinterpret_cast<__half2*>(y + o) = __halves2half2(lo, hi);
        }
    }
}

}  // namespace fllama

// The 128 accumulator operands of an m64n256 wgmma, with constraint C ("+r" for s32, "+f" for f32).
#define FLLAMA_D4(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3])
#define FLLAMA_D16(C, i) FLLAMA_D4(C, i), FLLAMA_D4(C, i + 4), FLLAMA_D4(C, i + 8), FLLAMA_D4(C, i + 12)
#define FLLAMA_D64(C, i) FLLAMA_D16(C, i), FLLAMA_D16(C, i + 16), FLLAMA_D16(C, i + 32), FLLAMA_D16(C, i + 48)
#define FLLAMA_D128(C) FLLAMA_D64(C, 0), FLLAMA_D64(C, 64)
#define FLLAMA_D128_LIST                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                  \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                  \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                  \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "      \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
