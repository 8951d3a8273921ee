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
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BM = 128, BN = 256, BK = 128;  // tokens, channels, k bytes per stage
constexpr int THREADS = 256;
constexpr int STAGES = 4, PREFETCH = 2;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // 16 KB + 32 KB per stage
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + SW128_ALIGN;  // the launcher's dynamic shared memory
static_assert(PREFETCH + 2 <= STAGES, "a copy may only overwrite the buffer of the tile two back");

// d[128] (this thread's share of the warpgroup's 64 x 256 int32 tile) += A (64 x 32 s8) * B (256 x 32 s8)^T.
__device__ __forceinline__ void wgmma_s8_m64n256k32(int (&d)[128], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 " FLLAMA_D128_LIST ", %128, %129, p;\n}\n"
                 : FLLAMA_D128("+r")
                 : "l"(da), "l"(db));
}

template <bool RESIDUAL>
__device__ __forceinline__ void int8_wgmma(__half* __restrict__ y, const int8_t* __restrict__ qx,
                                           const float* __restrict__ a_scale, int a_stride,
                                           const int8_t* __restrict__ qweight, const float* __restrict__ w_scale,
                                           const __half* __restrict__ residual, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)SMEM_BYTES) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
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
    const int dst = sw128(r0, c);  // rows r0 + 32 i keep r0's swizzle (32 % 8 == 0)

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
    wgmma_pipeline_start<PREFETCH>(d, tiles, load_tile);
    for (int kt = 0; kt < tiles; ++kt) {
        cp_async_wait<PREFETCH - 1>();  // this thread's copies of tile kt have landed
        fence_proxy_async();            // ... and are visible to the tensor cores (async proxy)
        __syncthreads();                // everyone's copies; every warpgroup has retired tile kt - 2's wgmma
        if (kt + PREFETCH < tiles) load_tile(kt + PREFETCH);
        cp_async_commit();
        const uint32_t sa = smem_addr + (kt % STAGES) * STAGE_BYTES + wg * (64 * BK);
        const uint32_t sb = smem_addr + (kt % STAGES) * STAGE_BYTES + A_BYTES;
        const uint64_t da = sw128_desc(sa), db = sw128_desc(sb);
        wgmma_stage<BK / 32>(d, da, db, [](auto& acc, uint64_t a, uint64_t b) { wgmma_s8_m64n256k32(acc, a, b); });
    }
    wgmma_drain(d);
    pdl_launch_dependents();

    // Epilogue straight from the accumulators (N % 8 == 0).
    const int m = m0 + wg * 64 + (warp & 3) * 16 + (lane >> 2);
    wgmma_store_rows<BN, RESIDUAL>(d, y, a_scale, a_stride, w_scale, residual, M, N, m, n0, lane,
                                   [](int acc, float as, float ws, const __half* r) {
                                       return int8_epilogue(acc, as, ws, r);
                                   });
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
