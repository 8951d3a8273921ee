// AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a), dequantization fused:
//   y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)  (model_zoo.quant.awq_pack's dequantizer)
// then the residual (an fp16 add) or SwiGLU of an interleaved gate|up weight, as awq_gemv.cu's epilogues.
//
// Why: the prefill path writes w_hat (13.5 GB of fp16 for LLaMA-2-7B at every 2048-token prefill) with
// awq_packed_dequant and multiplies with cuBLAS; the dequantize pass alone is ~12% of the prefill.
//
// The product is computed transposed, y^T = w_hat x^T, so that the weight is wgmma's A operand
// and A comes from registers ("RS" wgmma). w_hat never exists outside a thread's registers: each warp loads
// its 16-channel panel's packed words straight from global memory (the engine layout, awq_layout.cuh, is
// already the m16n8k16 A fragment that wgmma's register A takes per warp), converts them to w_hat fragments
// and feeds them to the tensor cores. Making w_hat in shared memory instead (a producer warpgroup converting
// into a ring that the consumers' SS wgmma read) leaves the tensor pipe nearly half idle, well below cuBLAS. Here
// shared memory holds only x.
//
// Block = 128 channels (two consumer warpgroups of 64: one panel per warp) x 256 tokens (wgmma N), 64 k per
// stage (half of one 128-k tile of the layout), plus a producer warpgroup (setmaxnreg: it keeps 40 registers
// a thread so that the consumers get 232). Clusters of two blocks with the same tokens and neighbouring
// channels share every x stage.
//   x: natural order, 256 token rows x 64 k a stage, brought by TMA (a tensor map in global memory,
//     tensor_map.py) in the 128-byte swizzle into a ring of XS slots. The producer's first thread copies
//     rows 128 rank .. + 127 of each stage into the same slot of both blocks of the pair (multicast: x is
//     read from L2 once per pair), completing on each block's `full` mbarrier of the slot (32 KB expected);
//     before it reuses a slot it waits on the slot's `empty` mbarrier, which the 8 consumer warps of both
//     blocks arrive on once their wgmma of the stage retired. Those arrivals are relaxed: a release would
//     make each arriving warp wait for its own weight loads in flight (the next tile's), and the wgmma's
//     shared-memory reads are complete once wgmma.wait_group returns, so nothing else needs ordering.
//     (cp.async copies of x, or TMA issued by a consumer behind a per-stage barrier, are slower;
//     FLLAMA_AWQ_WGMMA_CLUSTER=1 builds the kernel without multicast.)
//   k order: the layout's is not the natural one (lane t of a panel holds k 32 t .. 32 t + 31 of a 128-k
//     tile; natural mma steps want k 16 j + 2 t + {0, 1, 8, 9}), and permuting x instead costs 4-byte copies.
//     So each lane rearranges its words once per tile (natural_k_words): a 4 x 4 transpose of nibble columns
//     in its own four words, then a 4 x 4 word transpose across the quad of lanes (four shuffles), after
//     which word t' holds exactly the nibbles natural steps 2 t' and 2 t' + 1 need, where awq_a_frag reads them.
//   w: each lane loads its 2 x 16 bytes of packed words and its 8 bytes of group terms per 128-k tile, one
//     tile ahead in registers; the A fragments of a stage (4 k16 steps x 4 registers) are converted while the
//     previous stage's wgmma run, into the other of two register sets (the set a wgmma reads must not change
//     until that wgmma retires).
//   Epilogue: the accumulators (rows = channels, columns = tokens) go to shared memory transposed by
//     stmatrix .trans, then out in coalesced 16-byte rows of y (with the residual added, or as SwiGLU).
// Groups of 128 only (one term per channel and 128-k tile); other group sizes keep dequantize + cuBLAS.
// Tails: tokens past M and k past K are zero-filled x (TMA; the layout zero-pads the weights to whole tiles);
// panels past N / 16 (and the pair's second block past the last channel tile) compute on zeros, store nothing.
// grid (ceil(M / 256), ceil(N / 128) rounded up to even), cluster (1, 2); cluster_order maps the launch order
// to tiles so that a wave's x and weights stay in L2.
#include "awq_layout.cuh"
#include "awq_panel.cuh"
#include "common.cuh"
#include "gemm_common.cuh"
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BN = 128, BT = 256, BK = 64;  // channels, tokens, k per stage
static_assert(2 * BK == 128, "a stage is half of one 128-k tile of the layout");
constexpr int CONSUMERS = 256;               // two warpgroups issuing wgmma
constexpr int THREADS = CONSUMERS + 128;     // + a warpgroup of which one thread issues the x copies
// Registers: 384 threads start at 168 each (a sub-partition's 16K over its three warps); the producer
// warpgroup gives most of its own back so that the consumers can hold 128 accumulators and two A sets.
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(PRODUCER_REGS + 2 * CONSUMER_REGS <= 512, "three warps of a sub-partition share 16K registers");
#ifndef FLLAMA_AWQ_WGMMA_SLOTS
#define FLLAMA_AWQ_WGMMA_SLOTS 5
#endif
constexpr int XS = FLLAMA_AWQ_WGMMA_SLOTS;  // x stages in shared memory, 32 KB each
constexpr int X_BYTES = BT * SW128_ROW;   // 32 KB a stage
#ifndef FLLAMA_AWQ_WGMMA_CLUSTER
#define FLLAMA_AWQ_WGMMA_CLUSTER 2
#endif
constexpr int CLUSTER = FLLAMA_AWQ_WGMMA_CLUSTER;  // blocks of neighbouring channel tiles sharing each x stage
constexpr int X_PART = X_BYTES / CLUSTER;   // the rows of a stage each block of the pair copies for both
constexpr int BAR_OFFSET = XS * X_BYTES;    // mbarriers after the ring: full[XS], then empty[XS]
constexpr int FULL = 0, EMPTY = 8 * XS;
constexpr int SMEM_BYTES = BAR_OFFSET + 16 * XS + SW128_ALIGN;
static_assert(2 * BT * AWQ_ROW_PLAIN <= XS * X_BYTES, "the epilogue staging reuses the x ring");

// TMA: box (k0 .. k0 + 63, rows r0 .. r0 + 127) of x into the same shared-memory offset of both blocks of
// the pair (multicast), completing on the mbarrier at offset `bar` of each.
__device__ __forceinline__ void tma_load_x_pair(uint32_t dst, const void* tmap, uint32_t bar, int k0, int r0) {
    if (CLUSTER == 1) {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
            ::"r"(dst), "l"(tmap), "r"(k0), "r"(r0), "r"(bar)
            : "memory");
        return;
    }
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(tmap), "r"(k0), "r"(r0), "r"(bar), "h"((unsigned short)((1 << CLUSTER) - 1))
        : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Arrive on the mbarrier at shared offset `bar` of block `rank` of the cluster (this one included).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
    asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_map(bar, rank))
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// d[128] (the warpgroup's 64 channels x 256 tokens, fp32) += w_hat (64 x 16, registers) * x (256 x 16)^T.
__device__ __forceinline__ void wgmma_rs_m64n256k16(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 " FLLAMA_D128_LIST
                 ", {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
                 : FLLAMA_D128("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// The cluster's (token tile, channel-tile pair), in launch order: groups of GROUP token tiles, tokens fastest
// within a group, every pair of a group before the next group. A wave (66 pairs) then reads 8 x 256 rows of x
// (16 MB at K = 4096) and ~16 channel tiles of weights, which stay in L2; with all token tiles in one sweep
// (the grid's own order) a wave at 16384 tokens would stream all of x (128 MB) from DRAM again for every pair.
constexpr int GROUP = 8;
__device__ __forceinline__ void cluster_order(int& token_tile, int& pair) {
    const int T = gridDim.x, P = gridDim.y / CLUSTER;
    const int c = blockIdx.x + T * (blockIdx.y / CLUSTER);  // launch order of the clusters
    const int g = c / (GROUP * P), r = c - g * GROUP * P;
    const int size = min(GROUP, T - g * GROUP);
    token_tile = g * GROUP + r % size;
    pair = r / size;
}

// EPI 0: y [M, N];  1: + residual (fp16 add after rounding);  2: y [M, N / 2] = silu(gate) * up of a gate|up
// weight interleaved by 8 (each 16-channel panel: 8 gate channels, then the same 8 up channels).
template <int EPI>
// y and residual may be one buffer (the engine adds into the residual stream in place): not __restrict__.
__device__ __forceinline__ void awq_wgmma(__half* y, const void* __restrict__ xmap,
                                          const uint32_t* __restrict__ packed, const uint32_t* __restrict__ terms,
                                          const __half* residual, int M, int N, int K, int tiles) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)SMEM_BYTES) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, cw = warp >> 2, w = warp & 3;
    const uint32_t rank = cluster_rank();
    int token_tile, pair;
    cluster_order(token_tile, pair);
    const int m0 = token_tile * BT, n0 = (CLUSTER * pair + rank) * BN;
    const int stages = 2 * tiles;

    const uint32_t bars = smem_addr + BAR_OFFSET;
    if (tid == 0) {
        for (int i = 0; i < XS; ++i) {
            mbar_init(bars + FULL + 8 * i, 1);              // the producer's arrive + both halves' bytes
            mbar_init(bars + EMPTY + 8 * i, 8 * CLUSTER);   // every warp of both blocks has retired the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit, the peer
    }
    cluster_sync();  // the peer's copies and arrivals may target this block's barriers from here on

    // Stage kt: x[m0 .. m0 + 255][64 kt .. 64 kt + 63] (TMA fills rows past M and k past K with zeros); this
    // block copies rows 128 rank .. + 127 into both blocks of the pair, the peer the other half.
    if (tid >= CONSUMERS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        pdl_wait();  // x comes from the previous kernel
        if (tid == CONSUMERS) {
            // The map may have been written by put_map (tensor_map.cu, under a graph) since the TMA unit last read
            // a map at this address: generic-proxy stores reach the tensormap proxy only through this acquire.
            // Without it a replayed prefill graph reads stale maps: its capture gives several GEMMs' maps one block.
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(xmap) : "memory");
            RingPos<XS> xc;
            for (int kt = 0; kt < stages; ++kt) {
                mbar_wait(bars + EMPTY + 8 * xc.slot, xc.phase ^ 1);  // both blocks retired the slot's last stage
#ifndef FLLAMA_AWQ_TIMING_NO_X  // timing only (wrong results): no x copies at all
                mbar_arrive_expect_tx(bars + FULL + 8 * xc.slot, X_BYTES);
                tma_load_x_pair(smem_addr + xc.slot * X_BYTES + rank * X_PART, xmap, bars + FULL + 8 * xc.slot,
                                BK * kt, m0 + rank * (BT / CLUSTER));
#else
                mbar_arrive(bars + FULL + 8 * xc.slot);
#endif
                xc.next();
            }
        }
        __syncwarp();
        pdl_launch_dependents();
        cluster_sync();  // as the consumers' last step
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS));
    // The warp's panel: its first tile's words and terms (weights only: before the PDL wait).
    const int panel = n0 / 16 + warp;
    const bool panel_ok = panel < N / 16;
    const uint32_t* pk = packed + (size_t)(panel_ok ? panel : 0) * tiles * AWQ_TILE_WORDS;
    const uint32_t* tk = terms + (size_t)(panel_ok ? panel : 0) * tiles * 16;
    PanelTile cur = load_tile(pk, tk, 0, lane, panel_ok);
    PanelTile nxt = load_tile(pk, tk, 1, lane, panel_ok && tiles > 1);

    pdl_wait();  // the residual comes from the previous kernel

    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    uint32_t a[2][4][4];  // [stage parity][k16 step][register]
    natural_k(cur, lane);
    convert_stage(cur, 0, a[0]);
    RingPos<XS> xs;  // stage kt's slot
    int prev = 0;    // stage kt - 1's slot
    for (int tile = 0; tile < tiles; ++tile) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int kt = 2 * tile + half;
            mbar_wait(bars + FULL + 8 * xs.slot, xs.phase);
            const uint64_t db = sw128_desc(smem_addr + xs.slot * X_BYTES);
            fence_operands(d);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) wgmma_rs_m64n256k16(d, a[half][ks], db + 2 * ks);
            wgmma_commit();
            fence_operands(d);
            wgmma_wait<1>();  // stage kt - 1 retired: the other register set and its x slot are free
            if (kt > 0 && lane < CLUSTER) mbar_arrive_cluster(bars + EMPTY + 8 * prev, lane);  // both blocks'
            prev = xs.slot;
            xs.next();
            if (half == 0) {
                convert_stage(cur, 1, a[1]);
            } else if (tile + 1 < tiles) {
                cur = nxt;
                nxt = load_tile(pk, tk, tile + 2, lane, panel_ok && tile + 2 < tiles);
                natural_k(cur, lane);
                convert_stage(cur, 0, a[0]);
            }
        }
    }
    wgmma_drain(d);
    pdl_launch_dependents();
    named_barrier(1, CONSUMERS);  // both warpgroups are done with the x ring: it becomes the staging area
    const int rows_here = min(BT, M - m0);

    // The warpgroup's staging area in the x ring: BT rows of 64 channels (or 32 SwiGLU features).
    const int stage = cw * BT * (EPI == 2 ? AWQ_ROW_SILU : AWQ_ROW_PLAIN);
    awq_store_warpgroup<EPI, BT>(d, smem + stage, smem_addr + stage, w, lane, tid & 127, 2 + cw, y, residual, N, m0,
                                 rows_here, n0 + 64 * cw);
    cluster_sync();  // the peer may still arrive on this block's barriers until it leaves its main loop
}

}  // namespace

// (y fp16, xmap: the tensor map of x fp16 [M, K] (box 64 k x 256 / CLUSTER rows, 128-byte swizzle) in global
//  memory, packed u32 [N/16, tiles, 256], terms u32 [N/16, tiles, 8, 2] (groups of 128),
//  residual fp16 [M,N] or null, M, N, K, tiles); N % 16 == 0, K % 8 == 0; y, x, residual 16-byte aligned
//  with rows of a multiple of 8 values.
#define FLLAMA_AWQ_WGMMA(EPI, NAME)                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                \
        awq_wgmma_##NAME(__half* y, const void* xmap, const uint32_t* packed, const uint32_t* terms,        \
                         const __half* residual, int M, int N, int K, int tiles) {                         \
        awq_wgmma<EPI>(y, xmap, packed, terms, residual, M, N, K, tiles);                                     \
    }
FLLAMA_AWQ_WGMMA(0, plain)
FLLAMA_AWQ_WGMMA(1, res)
FLLAMA_AWQ_WGMMA(2, silu)
