// FP8 E4M3 W8A8 GEMM for decode batches of 17-64 token rows on Hopper's warpgroup tensor cores (wgmma e4m3, sm_90a),
// the contract of fp8_gemm.cu's GEMVs (model_zoo/quant/fp8.py, fp8_common.cuh):
//   y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])  (+ residual[m, n]),  acc = sum_k x8[m, k] * w8[n, k] in fp32
// plus the SwiGLU of an interleaved gate|up weight, and the deferred chain's side outputs (the next RMSNorm's xg,
// sums and maxima per 8 channels from the residual epilogue; the SwiGLU's maxima per 8 channels).
//
// Why: the GEMVs convert every e4m3 byte to fp16 in registers for mma.sync (Hopper has no e4m3 mma.sync), which at
// 32 rows costs more than streaming the weights; wgmma reads e4m3 straight from shared memory, so a block needs no
// conversions and one warpgroup keeps up with the copies.
//   y^T tile = W (64 channels: wgmma's M) x X^T (BT = 32 or 64 tokens: wgmma's N): 17-64 rows waste no weight
//   bandwidth (the channels are M) and a token tile is one wgmma N.
//   block = one consumer warpgroup (4 warps) + one producer warp. Per 128-k stage the producer's lane 0 copies the
//   weight box (64 rows x 128 B) by TMA (a map made once per weight) and all 32 lanes copy the activation box
//   (BT rows x 128 B) by cp.async, which needs no map, so the engine's graph-allocated activations work as they are.
//   Both land in a ring of STAGES slots in the 128-byte swizzle (wgmma.cuh) and complete on the slot's `full`
//   mbarrier (the weight's bytes + each lane's cp.async.mbarrier.arrive); the consumers give a slot back on its
//   `empty` mbarrier once its wgmma retired. The first STAGES weight boxes go before the PDL wait (weights do not
//   depend on the previous kernel).
//   Three blocks a SM (160 threads, <= 136 registers, 73 KB of shared memory at BT 32 (6 stages), 65 KB at 64 (4)):
//   up to 18 weight boxes of 8 KB in flight a SM, well over what the H200's bandwidth-latency product needs.
//   Two-level accumulation (fp8_wgmma.cu): Hopper's e4m3 wgmma keeps ~14 bits of its accumulator, so each stage's
//   128 k's are summed by 4 wgmma m64nBTk32 from zero into a chunk, and the chunk is added into the fp32
//   accumulator once retired. A group of GROUP stages is issued into GROUP chunk sets before the first is retired;
//   no group stays in flight across the loop's back edge (ptxas would serialize every wgmma, C7514).
//   Split K (gridDim.y) where the column blocks leave SMs idle: each block writes its fp32 accumulators to a
//   workspace in register order, the last block of a column (a counter, left at zero again) sums all splits' in
//   split order (deterministic whichever block is last) and runs the epilogue.
//   Epilogue straight from the accumulators: d[4j + 2h + e] is channel n0 + 16w + 8h + g, token m0 + 8j + 2t + e
//   (w: warp, g = lane / 4, t = lane % 4); the 8 channels of a group are the lanes of equal t, as in the GEMVs'
//   epilogues, so deferred_quant.cuh's fold8_store / swiglu_amax_store apply unchanged. SwiGLU: the interleaved
//   order (swiglu_layout.py) puts gate channel 16p + g (h = 0) and its up channel 16p + 8 + g (h = 1) in one thread.
// Tails: token rows past M and k's past K are zero-filled (cp.async src-size 0, the TMA unit), so 0 * code, never
// NaN, and never stored; channels past N likewise (N % 16 == 0).
#include "fp8_common.cuh"
#include "wgmma.cuh"

using namespace fllama;

namespace {

constexpr int BN = 64, BK = 128;          // channels a block (wgmma M), k codes a stage
constexpr int CONSUMERS = 128;            // the warpgroup issuing wgmma
constexpr int THREADS = CONSUMERS + 32;   // + the producer warp
constexpr int MIN_BLOCKS = 3;             // resident blocks a SM the registers are capped for
constexpr int W_BYTES = BN * BK;          // a stage's weight box, 1024-byte aligned in the stage
constexpr int FULL_ARRIVALS = 33;         // the weight copy's expect_tx + the 32 lanes' cp.async arrivals

template <int BT>
struct Shape {
    static_assert(BT == 32 || BT == 64, "wgmma n32 or n64");
    static constexpr int STAGES = BT == 32 ? 6 : 4;  // three blocks a SM within 228 KB
    // Stages issued before the first is retired. BT 32: 1 (H200, 32 rows: gate|up 27.8 us against 29.4 at 2);
    // BT 64: 2 (3 or more spill at three blocks a SM).
    static constexpr int GROUP = BT == 32 ? 1 : 2;
    static_assert(GROUP >= 1 && GROUP <= 4 && GROUP < STAGES, "wgmma_wait_n covers up to 3 groups in flight");
    static constexpr int X_BYTES = BT * BK;
    static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;  // a multiple of 1024: every box stays swizzle-aligned
    static constexpr int BAR = STAGES * STAGE_BYTES;       // mbarriers after the ring: full[STAGES], empty[STAGES]
    static constexpr int FULL = 0, EMPTY = 8 * STAGES;
    static constexpr int SMEM = BAR + 16 * STAGES + SW128_ALIGN;  // fp8_wgmma_decode.py smem_bytes
    static_assert(STAGE_BYTES % SW128_ALIGN == 0, "boxes must start on the swizzle period");
    static_assert(MIN_BLOCKS * (SMEM + 1024) <= 228 * 1024, "three blocks a SM (+1 KB reserved each)");
};

#define FP8D_LIST16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FP8D_LIST32                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (this thread's share of the 64 x BT fp32 chunk) = (ADD ? d : 0) + W (64 x 32 e4m3, desc da) * X (BT x 32, db)^T.
template <int ADD>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " FP8D_LIST16 ", %16, %17, p, 1, 1;\n}\n"
                 : FLLAMA_D16("+f", 0)
                 : "l"(da), "l"(db), "n"(ADD));
}
template <int ADD>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " FP8D_LIST32 ", %32, %33, p, 1, 1;\n}\n"
                 : FLLAMA_D16("+f", 0), FLLAMA_D16("+f", 16)
                 : "l"(da), "l"(db), "n"(ADD));
}

// One stage's 128 k's summed by the tensor cores from zero into chunk d, one commit group.
template <int N>
__device__ __forceinline__ void issue_stage(float (&d)[N], uint32_t stage_addr) {
    const uint64_t da = sw128_desc(stage_addr), db = sw128_desc(stage_addr + W_BYTES);
    fence_operands(d);
    wgmma_fence();
    wgmma_e4m3<0>(d, da, db);
#pragma unroll
    for (int ks = 1; ks < BK / 32; ++ks) wgmma_e4m3<1>(d, da + 2 * ks, db + 2 * ks);  // +32 bytes a k32 step
    wgmma_commit();
}

// A retired chunk added into acc in fp32 (the second level of the accumulation).
template <int N>
__device__ __forceinline__ void promote(float (&acc)[N], float (&d)[N]) {
    fence_operands(d);
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = __fadd_rn(acc[i], d[i]);
}

// The producer warp: stage s = the block's k tile t0 + s. Lane 0 copies the weight boxes (k, n0) by TMA; every lane
// copies BT / 4 16-byte chunks of each stage's activation box (chunk c = 32 i + lane: row c / 8, 16-byte column
// c % 8, stored at sw128(row, column), the layout of the TMA unit's 128-byte swizzle) and arrives on the slot's
// full mbarrier when they land (noinc: the lane never waits for them, as CUTLASS's cp.async sm90 mainloop).
// early: the first STAGES weight boxes go before the PDL wait; 0 where the kernel before may be the put_map that
// writes the weight's map (made under graph capture, tensor_map.py). The tensormap-proxy acquire makes a put_map's
// stores visible to the TMA unit.
template <int BT>
__device__ __forceinline__ void produce(unsigned char* smem, uint32_t smem_addr, uint32_t bars,
                                        const uint8_t* __restrict__ x8, const void* wmap, int t0, int nt, int n0,
                                        int m0, int M, int K, int early, int lane) {
    using S = Shape<BT>;
    if (!early) pdl_wait();
    const int pre = min(nt, S::STAGES);
    if (lane == 0) {
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(wmap) : "memory");
        for (int s = 0; s < pre; ++s) {  // fresh slots: no empty wait
            const uint32_t full = bars + S::FULL + 8 * s;
            mbar_expect_tx(full, W_BYTES);
            tma_load_2d(smem_addr + s * S::STAGE_BYTES, wmap, full, (t0 + s) * BK, n0);
        }
    }
    if (early) pdl_wait();  // x8 comes from the previous kernel
    RingPos<S::STAGES> put;
    for (int s = 0; s < nt; ++s) {
        const uint32_t full = bars + S::FULL + 8 * put.slot;
        if (s >= pre) {
            mbar_wait(bars + S::EMPTY + 8 * put.slot, put.phase ^ 1);  // the consumers retired the slot's last stage
            if (lane == 0) {
                mbar_expect_tx(full, W_BYTES);
                tma_load_2d(smem_addr + put.slot * S::STAGE_BYTES, wmap, full, (t0 + s) * BK, n0);
            }
        }
        unsigned char* xs = smem + put.slot * S::STAGE_BYTES + W_BYTES;
        const int k0 = (t0 + s) * BK;
#pragma unroll
        for (int i = 0; i < BT / 4; ++i) {
            const int c = 32 * i + lane, row = c >> 3, col = c & 7, k = k0 + 16 * col;
            const bool ok = m0 + row < M && k < K;  // K % 16 == 0: a chunk is all in or all out
            cp_async16(xs + sw128(row, col), ok ? x8 + (size_t)(m0 + row) * K + k : x8, ok);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
        put.next();
    }
}

__device__ __forceinline__ void wgmma_wait_n(int n) {  // n is a constant once the callers' loops are unrolled
    if (n <= 0) wgmma_wait<0>();
    else if (n == 1) wgmma_wait<1>();
    else if (n == 2) wgmma_wait<2>();
    else wgmma_wait<3>();
}

// The consumers' main loop: acc = sum over the block's nt stages of each stage's chunk, in stage order. Each stage
// of a group is issued into its own chunk set as its data lands (one commit group each; an empty group past the
// last stage, so that the waits count GROUP groups), then the chunks are retired in order, promoted, and their slots
// given back. The fence after the full wait orders the producer's cp.async (generic proxy) writes before wgmma's
// (async proxy) reads.
template <int BT>
__device__ __forceinline__ void consume(float (&acc)[BT / 2], uint32_t smem_addr, uint32_t bars, int nt, int lane) {
    using S = Shape<BT>;
    constexpr int N = BT / 2;
    constexpr int GROUP = S::GROUP;
    float c[GROUP][N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < GROUP; ++q)
#pragma unroll
        for (int i = 0; i < N; ++i) c[q][i] = 0.0f;  // (scale-d 0 ignores them; defined for ptxas)
    RingPos<S::STAGES> cur;
    for (int s = 0; s < nt; s += GROUP) {
        int slot[GROUP];
#pragma unroll
        for (int q = 0; q < GROUP; ++q) {
            slot[q] = cur.slot;
            if (s + q < nt) {
                mbar_wait(bars + S::FULL + 8 * cur.slot, cur.phase);
                fence_proxy_async();
                issue_stage(c[q], smem_addr + cur.slot * S::STAGE_BYTES);
                cur.next();
            } else {
                wgmma_commit();  // an empty group
            }
        }
#pragma unroll
        for (int q = 0; q < GROUP; ++q) {
            wgmma_wait_n(GROUP - 1 - q);
            if (s + q < nt) {
                promote(acc, c[q]);
                if (lane == 0) mbar_arrive_relaxed(bars + S::EMPTY + 8 * slot[q]);
            }
        }
    }
}

enum Epi { EPI_PLAIN = 0, EPI_RES = 1, EPI_SILU = 2 };

// Split K: this block's accumulators into the workspace, element i of thread tid at [i / 4][tid][i % 4] of its
// (split, column) piece (float4 stores, consecutive threads consecutive 16 bytes); the last block of the column reads
// every split's piece back in split order (its own included, so the sums do not depend on which block is last).
// Returns false for the blocks that are not last.
template <int N>
__device__ __forceinline__ bool split_combine(float (&d)[N], float* __restrict__ partial, int* __restrict__ counters,
                                              int tid) {
    __shared__ int s_last;
    const int column = blockIdx.z * gridDim.x + blockIdx.x, columns = gridDim.x * gridDim.z;
    const int splits = gridDim.y;
    constexpr int PIECE = CONSUMERS * N;  // floats of one block's tile
    float4* mine = reinterpret_cast<float4*>(partial + ((size_t)blockIdx.y * columns + column) * PIECE);
#pragma unroll
    for (int q = 0; q < N / 4; ++q)
        mine[q * CONSUMERS + tid] = make_float4(d[4 * q], d[4 * q + 1], d[4 * q + 2], d[4 * q + 3]);
    __threadfence();
    named_barrier(1, CONSUMERS);
    if (tid == 0) {
        s_last = atomicAdd(&counters[column], 1) == splits - 1;
        if (s_last) atomicExch(&counters[column], 0);  // ready for the next launch (graph replays)
    }
    named_barrier(1, CONSUMERS);
    if (!s_last) return false;
    __threadfence();  // the other blocks' partials are read after this
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
        const float4* p = reinterpret_cast<const float4*>(partial + ((size_t)sp * columns + column) * PIECE);
#pragma unroll
        for (int q = 0; q < N / 4; ++q) {
            const float4 v = __ldcg(p + q * CONSUMERS + tid);
            d[4 * q] += v.x;
            d[4 * q + 1] += v.y;
            d[4 * q + 2] += v.z;
            d[4 * q + 3] += v.w;
        }
    }
    return true;
}

// The epilogue: fp8_gemm.cu's per-element rounding (fp8_epilogue), its fold (fold8_*) and SwiGLU (silu_h, one fp16
// multiply; swiglu_amax_store) on this thread's accumulators. Every lane runs every (j, e) step (the shuffles).
template <int EPI, int BT>
__device__ __forceinline__ void store(const float (&d)[BT / 2], __half* y, const float* __restrict__ a_scale,
                                      int a_stride, const float* __restrict__ w_scale, const __half* residual,
                                      const Int8Fold& fold, float* __restrict__ part, int M, int N, int m0, int n0,
                                      int warp, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const int nl = n0 + 16 * warp + g, nh = nl + 8;  // this thread's channels (h = 0, 1)
    const bool ok_l = nl < N, ok_h = nh < N;         // N % 16 == 0: ok_l == ok_h
    const float ws_l = ok_l ? w_scale[nl] : 0.0f, ws_h = ok_h ? w_scale[nh] : 0.0f;
    const bool folds = EPI == EPI_RES && fold.xg != nullptr;  // block-uniform
    const __half zero = __float2half_rn(0.0f);
    const __half fw_l = folds && ok_l ? fold.w[nl] : zero, fw_h = folds && ok_h ? fold.w[nh] : zero;
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int m = m0 + 8 * j + 2 * t + e;
            const float as = m < M ? a_scale[(size_t)m * a_stride] : 0.0f;
            if constexpr (EPI == EPI_SILU) {
                float amax = 0.0f;
                if (m < M && ok_l) {
                    const __half gate = fp8_epilogue(d[4 * j + e], as, ws_l, nullptr);
                    const __half up = fp8_epilogue(d[4 * j + 2 + e], as, ws_h, nullptr);
                    const __half a = __hmul_rn(silu_h(__half2float(gate)), up);
                    y[(size_t)m * (N / 2) + n0 / 2 + 8 * warp + g] = a;
                    amax = fabsf(__half2float(a));
                }
                if (part != nullptr && ok_l)  // warp-uniform (N % 16 == 0: a panel is all in or out)
                    swiglu_amax_store(amax, lane, m, M, part, n0 / 16 + warp, N / 16, nullptr);
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int n = h ? nh : nl;
                    float sq = 0.0f, mx = 0.0f;
                    if (m < M && (h ? ok_h : ok_l)) {
                        const size_t o = (size_t)m * N + n;
                        const __half v = fp8_epilogue(d[4 * j + 2 * h + e], as, h ? ws_h : ws_l,
                                                      EPI == EPI_RES ? residual + o : nullptr);
                        y[o] = v;
                        if (folds) fold8_values(fold, v, h ? fw_h : fw_l, o, sq, mx);
                    }
                    if (folds) fold8_store(fold, sq, mx, lane, m, M, n, N);
                }
            }
        }
    }
}

// y and residual may be one buffer (the engine adds into the residual stream in place): not __restrict__.
template <int EPI, int BT>
__device__ __forceinline__ void fp8_wgmma_decode(__half* y, const uint8_t* __restrict__ x8,
                                                 const float* __restrict__ a_scale, int a_stride, const void* wmap,
                                                 const float* __restrict__ w_scale, const __half* residual,
                                                 Int8Fold fold, float* part, float* __restrict__ partial,
                                                 int* __restrict__ counters, int M, int N, int K, int tps, int early) {
    using S = Shape<BT>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)S::SMEM) __trap();  // the launcher disagrees with this layout
    unsigned char* smem = sw128_base(smem_raw);
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t bars = smem_addr + S::BAR;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.z * BT;
    const int tiles = (K + BK - 1) / BK;
    const int t0 = blockIdx.y * tps, nt = min(tps, tiles - t0);  // >= 1: the launcher leaves no split empty
    if (tid == 0) {
        for (int i = 0; i < S::STAGES; ++i) {
            mbar_init(bars + S::FULL + 8 * i, FULL_ARRIVALS);
            mbar_init(bars + S::EMPTY + 8 * i, CONSUMERS / 32);  // every consumer warp retired the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
    __syncthreads();

    if (warp == CONSUMERS / 32) {
        produce<BT>(smem, smem_addr, bars, x8, wmap, t0, nt, n0, m0, M, K, early, lane);
        return;
    }
    pdl_wait();  // a_scale, the residual, y's and the workspace's readers: the previous kernels
    pdl_gemv_started(M);
    float acc[BT / 2];
    consume<BT>(acc, smem_addr, bars, nt, lane);
    pdl_gemv_streamed();
    if (gridDim.y > 1 && !split_combine(acc, partial, counters, tid)) return;
    store<EPI, BT>(acc, y, a_scale, a_stride, w_scale, residual, fold, part, M, N, m0, n0, warp, lane);
}

}  // namespace

// (y fp16 [M,N] (silu: [M,N/2]), x8 e4m3 [M,K] (16-byte aligned), a_scale f32 [M] or [1], a_stride 1|0, wmap: the
//  tensor map of w8 e4m3 [N,K] (box 128 k x 64 rows, 128-byte swizzle) in global memory (tensor_map.py), w_scale f32
//  [N], residual fp16 [M,N] or null (may be y), fold_w fp16 [N] or null, fold_xg fp16 [M,N], fold_sq f32 [M,N/8],
//  fold_mx f32 [M,N/8] (res: the next RMSNorm deferred, int8's format), part f32 [M,N/16] or null (silu: max |y| per
//  8 outputs), partial f32 workspace [splits * N/64 * ceil(M/BT) * 64 * BT] (unused with one split), counters int32
//  [N/64 * ceil(M/BT)] zero, M, N, K, tiles_per_split, early (1: the weight map was made before this launch));
//  K % 16 == 0, N % 16 == 0. grid (ceil(N / 64), splits, ceil(M / BT)), block 160, dynamic shared memory
//  fp8_wgmma_decode.py smem_bytes(BT).
#define FLLAMA_FP8_WGMMA_DECODE(BT, EPI, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) fp8_wgmma_decode_t##BT##_##NAME(             \
        __half* y, const uint8_t* x8, const float* a_scale, int a_stride, const void* wmap, const float* w_scale,  \
        const __half* residual, const __half* fold_w, __half* fold_xg, float* fold_sq, float* fold_mx, float* part, \
        float* partial, int* counters, int M, int N, int K, int tps, int early) {                                  \
        fp8_wgmma_decode<EPI, BT>(y, x8, a_scale, a_stride, wmap, w_scale, residual,                               \
                                  Int8Fold{fold_w, fold_xg, fold_sq, fold_mx}, part, partial, counters, M, N, K,   \
                                  tps, early);                                                                     \
    }
#define FLLAMA_FP8_WGMMA_DECODE_EPIS(BT)                                                                     \
    FLLAMA_FP8_WGMMA_DECODE(BT, EPI_PLAIN, plain)                                                            \
    FLLAMA_FP8_WGMMA_DECODE(BT, EPI_RES, res) FLLAMA_FP8_WGMMA_DECODE(BT, EPI_SILU, silu)
FLLAMA_FP8_WGMMA_DECODE_EPIS(32)
FLLAMA_FP8_WGMMA_DECODE_EPIS(64)
