// AWQ W4A16 GEMM for decode batches on Hopper's warpgroup tensor cores (wgmma, sm_90a), groups of 128 (the engine
// takes it from awq_gemv.WGMMA_DECODE_MIN_M = 32 to 64 tokens), dequantization fused:
//   y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)
// then the residual or SwiGLU epilogue of awq_wgmma.cu.
//
// Why: awq_batch.cu (mma.sync, every warp converting its panel's fragments for its token half, B fragments by
// shared-memory loads) takes ~4x the weights' streaming time at 32 tokens. A batch of 32 tokens is a GEMV in its
// bytes (8 KB of x per 1 KB of weight tile, from L2) but needs the tensor cores for its math. Here each warp's
// fragments are converted once for all the block's tokens, and one wgmma of m64 nBT k16 (BT = 32 or 64 tokens,
// the x stage in shared memory) does the work of 4-8 mma.sync and their B loads.
//   block = one consumer warpgroup (4 warps, a 16-channel panel each: 64 channels, as awq_wgmma.cu's warps) + one
//     copy warp; two blocks an SM (registers capped for it), so that one block's ramp hides under another's stream.
//   w: each lane's 2 x 16 bytes of packed words and 8 bytes of terms of a 128-k tile go straight to registers, LA
//     tiles ahead, then natural_k + convert to the two A sets of a tile (awq_panel.cuh), alternating so that tile
//     t + 1 converts while tile t's eight wgmma run.
//   x: the copy warp brings BT token rows x 64 k a stage (cp.async, 128-byte swizzle, rows past M and k past K
//     zero) into a ring of XS slots; it waits for its own copies, fences them to the async proxy and arrives on the
//     slot's `full` mbarrier; the consumers arrive (relaxed) on `empty` once a stage's wgmma retired. No TMA: a
//     decode step is a CUDA graph, where a tensor map per GEMM would cost a kernel of its own (tensor_map.py).
//   K is split over gridDim.y blocks when the 64-channel blocks alone leave SMs idle (o_proj, down_proj): each
//     block writes fp32 partials, the last of a column (a counter) sums them in split order (deterministic) into
//     its accumulators and runs the epilogue; with one split the block writes y directly.
//   Epilogue (awq_panel.cuh's awq_store_warpgroup, as awq_wgmma.cu's): accumulators (rows = channels, columns =
//     tokens) staged transposed by stmatrix in the x ring, then coalesced 16-byte rows of y.
// Entry points awq_wgmma_decode_t{BT}_{plain|res|silu}(y, x, packed, terms, residual, partial, counters, M, N, K,
//   tiles, tiles_per_split); grid (N / 64, splits, ceil(M / BT)), block 160, dynamic shared memory
//   awq_wgmma_decode.py's smem_bytes(BT).
#include "awq_layout.cuh"
#include "awq_panel.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BN = 64;                   // channels per block: one panel per consumer warp
constexpr int BK = 64;                   // k per x stage: half of one 128-k tile, one 128-byte swizzled row
constexpr int CONSUMERS = 128;           // the warpgroup issuing wgmma
constexpr int THREADS = CONSUMERS + 32;  // + the copy warp
// Resident blocks an SM the registers are capped for (168 a thread). Two of 160 threads hide one block's ramp under
// another's stream; three (128 registers) spill.
constexpr int MIN_BLOCKS = 2;
// Weight tiles in registers ahead of the one being converted (4 or 6 are slower at 32-64 tokens).
constexpr int LA = 2;
static_assert(LA % 2 == 0, "a tile's A set is its parity: the ring of LA tiles must keep it");
constexpr int XS = 8;  // x stages in the ring (more gain nothing)
// Copy groups the copy warp keeps in flight before arriving. The consumers hold a tile's two stages at once and
// release tile t - 1's only after issuing tile t, so the copy warp must not wait on a slot they still hold: XS - 4.
constexpr int XD = XS - 4;

template <int BT>
struct Layout {
    static_assert(BT == 32 || BT == 64, "wgmma n32 or n64");
    static constexpr int X_BYTES = BT * SW128_ROW;   // one stage
    static constexpr int BAR = XS * X_BYTES;         // mbarriers after the ring: full[XS], empty[XS]
    static constexpr int FULL = 0, EMPTY = 8 * XS;
    static constexpr int SMEM = BAR + 16 * XS + SW128_ALIGN;
    static_assert(BT * AWQ_ROW_PLAIN <= BAR, "the epilogue staging reuses the x ring");
};

// d (the warpgroup's 64 channels x BT tokens, fp32) += w_hat (64 x 16, registers) * x (BT x 16)^T.
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : FLLAMA_D16("+f", 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : FLLAMA_D16("+f", 0), FLLAMA_D16("+f", 16)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// Both stages' A fragments of a tile (k16 steps 0-3, 4-7): its packed words rearranged, then converted.
__device__ __forceinline__ void convert_tile(PanelTile& pt, int lane, uint32_t (&a)[2][4][4]) {
    natural_k(pt, lane);
    convert_stage(pt, 0, a[0]);
    convert_stage(pt, 1, a[1]);
}

template <int EPI, int BT>
// y and residual may be one buffer (the engine adds into the residual stream in place): not __restrict__.
__device__ __forceinline__ void awq_wgmma_decode(__half* y, const __half* __restrict__ x,
                                                 const uint32_t* __restrict__ packed,
                                                 const uint32_t* __restrict__ terms, const __half* residual,
                                                 float* __restrict__ partial, int* __restrict__ counters, int M,
                                                 int N, int K, int tiles, int tps) {
    using L = Layout<BT>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)L::SMEM) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * BN, split = blockIdx.y, splits = gridDim.y, m0 = blockIdx.z * BT;
    const int t0 = split * tps, nt = min(tps, tiles - t0);  // >= 1: the launcher leaves no split empty
    const uint32_t bars = smem_addr + L::BAR;
    __shared__ int s_last;
    if (tid == 0) {
        for (int i = 0; i < XS; ++i) {
            mbar_init(bars + L::FULL + 8 * i, 32);  // every lane of the copy warp, its own copies landed
            mbar_init(bars + L::EMPTY + 8 * i, CONSUMERS / 32);
        }
    }
    __syncthreads();

    if (warp == CONSUMERS / 32) {
        // The copy warp. Stage kt: x[m0 .. m0 + BT - 1][k0 + 64 kt ..] in the 128-byte swizzle, chunk i * 32 + lane.
        pdl_wait();  // x comes from the previous kernel
        const int k0 = t0 * 128;
        RingPos<XS> wr, ar;  // the slot being written, the slot to arrive on next
        int pending = 0;
        for (int kt = 0; kt < 2 * nt; ++kt) {
            mbar_wait(bars + L::EMPTY + 8 * wr.slot, wr.phase ^ 1);
            unsigned char* slot = smem + wr.slot * L::X_BYTES;
#pragma unroll
            for (int i = 0; i < BT * 8 / 32; ++i) {
                const int c = i * 32 + lane, row = c >> 3, ch = c & 7;
                const int k = k0 + BK * kt + 8 * ch;
                const bool ok = m0 + row < M && k < K;
                cp_async16(slot + sw128(row, ch), ok ? x + (size_t)(m0 + row) * K + k : x, ok);
            }
            cp_async_commit();
            wr.next();
            if (++pending > XD) {
                cp_async_wait<XD>();
                fence_proxy_async();  // the copies are read by wgmma (the async proxy)
                mbar_arrive(bars + L::FULL + 8 * ar.slot);
                ar.next();
                --pending;
            }
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (; pending > 0; --pending) {
            mbar_arrive(bars + L::FULL + 8 * ar.slot);
            ar.next();
        }
        return;
    }

    // The warp's panel; its first LA tiles (weights only: before the PDL wait).
    const int panel = n0 / 16 + warp;
    const bool panel_ok = panel < N / 16;
    const uint32_t* pk = packed + ((size_t)(panel_ok ? panel : 0) * tiles + t0) * AWQ_TILE_WORDS;
    const uint32_t* tk = terms + ((size_t)(panel_ok ? panel : 0) * tiles + t0) * 16;
    PanelTile buf[LA];
#pragma unroll
    for (int j = 0; j < LA; ++j) buf[j] = load_tile(pk, tk, j, lane, panel_ok && j < nt);

    pdl_wait();  // the residual (and y's readers) come from the previous kernels

    float d[BT / 2];
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) d[i] = 0.f;
    uint32_t a[2][2][4][4];  // [tile parity][stage of the tile][k16 step][register]
    convert_tile(buf[0], lane, a[0]);
    buf[0] = load_tile(pk, tk, LA, lane, panel_ok && LA < nt);
    RingPos<XS> xs;
    int prev0 = 0, prev1 = 0;  // tile t - 1's two slots
    for (int tb = 0; tb < nt; tb += LA) {
#pragma unroll
        for (int j = 0; j < LA; ++j) {
            const int t = tb + j;
            if (t >= nt) break;
            const int s0 = xs.slot;
            mbar_wait(bars + L::FULL + 8 * s0, xs.phase);
            xs.next();
            const int s1 = xs.slot;
            mbar_wait(bars + L::FULL + 8 * s1, xs.phase);
            xs.next();
            const uint64_t d0 = sw128_desc(smem_addr + s0 * L::X_BYTES);
            const uint64_t d1 = sw128_desc(smem_addr + s1 * L::X_BYTES);
            fence_operands(d);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) wgmma_rs(d, a[j & 1][0][ks], d0 + 2 * ks);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) wgmma_rs(d, a[j & 1][1][ks], d1 + 2 * ks);
            wgmma_commit();
            fence_operands(d);
            wgmma_wait<1>();  // tile t - 1 retired: its A set and its two slots are free
            if (t > 0 && lane == 0) {
                mbar_arrive_relaxed(bars + L::EMPTY + 8 * prev0);
                mbar_arrive_relaxed(bars + L::EMPTY + 8 * prev1);
            }
            prev0 = s0;
            prev1 = s1;
            if (t + 1 < nt) {
                PanelTile& b = buf[(j + 1) % LA];
                convert_tile(b, lane, a[(j + 1) & 1]);
                b = load_tile(pk, tk, t + 1 + LA, lane, panel_ok && t + 1 + LA < nt);
            }
        }
    }
    wgmma_wait<0>();
    fence_operands(d);
    pdl_launch_dependents();

    // Accumulator d[4 j + 2 h + e]: channel n0 + 16 warp + 8 h + lane / 4, token m0 + 8 j + 2 (lane % 4) + e.
    const int g = lane >> 2, t4 = lane & 3;
    if (splits > 1) {
        const int nc = n0 + 16 * warp + g;
#pragma unroll
        for (int j = 0; j < BT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = m0 + 8 * j + 2 * t4 + e;
                if (m < M && panel_ok) {
                    float* row = partial + ((size_t)split * M + m) * N + nc;  // [splits, M, N]
                    row[0] = d[4 * j + e];
                    row[8] = d[4 * j + 2 + e];
                }
            }
        __threadfence();
        named_barrier(1, CONSUMERS);
        if (tid == 0) {
            int* counter = &counters[blockIdx.z * gridDim.x + blockIdx.x];
            s_last = atomicAdd(counter, 1) == splits - 1;
            if (s_last) atomicExch(counter, 0);  // ready for the next launch (graph replays)
        }
        named_barrier(1, CONSUMERS);
        if (!s_last) return;
        __threadfence();  // the other blocks' partials are read after this
#pragma unroll
        for (int j = 0; j < BT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int m = m0 + 8 * j + 2 * t4 + e;
                float lo = 0.f, hi = 0.f;
                if (m < M && panel_ok) {
                    for (int sp = 0; sp < splits; ++sp) {
                        const float* row = partial + ((size_t)sp * M + m) * N + nc;
                        lo += __ldcg(row);
                        hi += __ldcg(row + 8);
                    }
                }
                d[4 * j + e] = lo;
                d[4 * j + 2 + e] = hi;
            }
    }
    named_barrier(1, CONSUMERS);  // every warp is done with the x ring: it becomes the staging area
    const int rows_here = min(BT, M - m0);
    awq_store_warpgroup<EPI, BT>(d, smem, smem_addr, warp, lane, tid, 1, y, residual, N, m0, rows_here, n0);
}

}  // namespace

// (y fp16, x fp16 [M, K], packed u32 [N/16, tiles, 256], terms u32 [N/16, tiles, 8, 2] (groups of 128), residual
//  fp16 [M, N] or null, partial fp32 [splits, M, N] (unused with one split), counters int32 [N/64 * token tiles],
//  M, N, K, tiles, tiles_per_split); N % 64 == 0, K % 8 == 0; y, x, residual 16-byte aligned.
#define FLLAMA_AWQ_WGMMA_DECODE(BT, EPI, NAME)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) awq_wgmma_decode_t##BT##_##NAME(            \
        __half* y, const __half* x, const uint32_t* packed, const uint32_t* terms, const __half* residual,       \
        float* partial, int* counters, int M, int N, int K, int tiles, int tps) {                                \
        awq_wgmma_decode<EPI, BT>(y, x, packed, terms, residual, partial, counters, M, N, K, tiles, tps);       \
    }
#define FLLAMA_AWQ_WGMMA_DECODE_EPIS(BT)                                                        \
    FLLAMA_AWQ_WGMMA_DECODE(BT, 0, plain) FLLAMA_AWQ_WGMMA_DECODE(BT, 1, res) FLLAMA_AWQ_WGMMA_DECODE(BT, 2, silu)
FLLAMA_AWQ_WGMMA_DECODE_EPIS(32)
FLLAMA_AWQ_WGMMA_DECODE_EPIS(64)
