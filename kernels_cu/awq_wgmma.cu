// AWQ W4A16 prefill GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a), dequantization fused:
//   y[m, n] = fp16(sum_k x[m, k] * w_hat[n, k]),  w_hat = fp16((q - z) * s)  (calibrate.awq_pack's dequantizer)
// then the residual (an fp16 add) or SwiGLU of an interleaved gate|up weight, as awq_gemv.cu's epilogues.
//
// Why: the prefill path writes w_hat (13.5 GB of fp16 for LLaMA-2-7B at every prefill) with
// awq_packed_dequant and multiplies with cuBLAS; the dequantize pass alone takes ~5 ms of a 2048-token
// prefill. Here w_hat only ever exists in shared memory, one 64-k slice at a time. Not yet faster than
// that path, so the engine does not call it.
//
// Block = 128 tokens x 256 channels, 64 k per stage (128 bytes of fp16 per row: one row of wgmma.cuh's
// 128-byte swizzle), three warpgroups (warp specialization, as CUTLASS's sm90 kernels):
//   warpgroup 0, the producer, dequantizes. Thread t owns channels n0 + t and n0 + t + 128: cp.async brings
//     their 32 bytes of packed int4 per stage (lanes t, t + 1 of the engine layout: 64 consecutive k) and
//     group terms into a packed ring; PREFETCH stages later, once they have landed, it writes the channels'
//     64 + 64 w_hat values into rows t, t + 128 of a w_hat slot (16 x 16-byte st.shared), fences them to the
//     async proxy and arrives on the slot's `w_full` mbarrier (128 arrivals).
//   warpgroups 1 and 2, the consumers, each own 64 tokens. Each copies its own x rows (cp.async, PREFETCH
//     stages ahead, 4 x 16 bytes a thread) into an x ring, so no other warpgroup touches them: per stage it
//     waits for its copies and a warpgroup barrier, then for `w_full`, issues 4 wgmma m64n256k16 and, once the
//     previous stage's wgmma has retired, arrives (one lane per warp) on that stage's `w_empty`, which the
//     producer waits for before it rewrites the slot.
// Why the split, and where it stands (H200, 2048 tokens; awq_wgmma.py has the table): with one barrier per
// stage and every warp copying, converting and issuing (this kernel's first version) the tensor cores idled
// while the conversion ran: 427-446 TFLOP/s. A producer warpgroup that also made the x copies (the second)
// was the bottleneck: Nsight Compute showed the consumers waiting on `w_full` for 40% of their samples while
// each producer warp issued 447 instructions a stage at 0.2 IPC, 40% of them address arithmetic of the x
// copies. The consumers have issue slots to spare while their wgmma run, so the x copies are theirs now
// (446-465 TFLOP/s). What is left: the tensor pipe is active 56% of the time against cuBLAS's 95%, and the
// conversion still costs ~18% (512-569 without it). Not for want of producer warps: a trial with two producer
// warpgroups (192-channel blocks, 512 threads, one channel a thread) lost the same share to the conversion
// (371-411 against 427-501 without it). That points at the amount of conversion work: each 128-token block converts
// its weights again (16 times per weight at 2048 tokens, where dequantize + cuBLAS converts once), so the next
// step to try is more tokens per converted tile (256 x 128 blocks, each consumer two m64n128) and a persistent grid
// (the prologue and epilogue are not overlapped, 5.8 waves).
// Slots: x (XS = PREFETCH + 2: a copy issued after stage kt overwrites stage kt - 2's, which every warp of
// the warpgroup retired before the barrier of stage kt), w_hat (WS, guarded by w_full / w_empty), packed
// words (PS = PREFETCH + 1, the producer's own). The producer waits only for w_empty of stage kt - WS, whose
// consumers need `w_full` of earlier stages only, so the hand-off cannot deadlock.
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
constexpr int PRODUCERS = 128, THREADS = PRODUCERS + 256;
// H200 at 2048 tokens: PREFETCH 2 or 3, WS 3 or 4 all ran at 446-465 TFLOP/s; PREFETCH 1 lost 7%.
constexpr int PREFETCH = 2, XS = PREFETCH + 2, WS = 3, PS = PREFETCH + 1;
constexpr int TILE_WORDS = 256;                 // the engine layout's 1 KB panel tile of 128 k (awq_gemv.cu)
constexpr int X_BYTES = BM * SW128_ROW;         // 16 KB: both consumers' 64 rows
constexpr int W_BYTES = BN * SW128_ROW;         // 32 KB
constexpr int RAW_BYTES = BN * 32;              // 8 KB: each channel's two 16-byte lane chunks
constexpr int TERM_BYTES = BN * 4;              // 1 KB
constexpr int PACKED_BYTES = RAW_BYTES + TERM_BYTES;
constexpr int W_OFFSET = XS * X_BYTES, P_OFFSET = W_OFFSET + WS * W_BYTES, BAR_OFFSET = P_OFFSET + PS * PACKED_BYTES;
constexpr int W_FULL = 0, W_EMPTY = 8 * WS;  // mbarriers: w_full[WS], then w_empty[WS]
constexpr int SMEM_BYTES = BAR_OFFSET + 16 * WS + SW128_ALIGN;  // 188 KB of the 227 an SM has
static_assert(X_BYTES % SW128_ALIGN == 0 && W_BYTES % SW128_ALIGN == 0, "tiles must stay 1024-byte aligned");
static_assert(BN == 2 * PRODUCERS, "two channels per producer thread");

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

// The producer warpgroup's whole job (thread t = 0..127).
__device__ __forceinline__ void awq_wgmma_produce(unsigned char* smem, uint32_t bars,
                                                  const uint32_t* __restrict__ packed,
                                                  const uint32_t* __restrict__ terms, int N, int stages,
                                                  int tiles, int n0, int t) {
    // The two channels: their lane chunks (g, t) of rows h of panel n / 16, and their group terms.
    const uint32_t* w_src[2];
    const uint32_t* t_src[2];
    bool n_ok[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int n = n0 + t + PRODUCERS * j;
        n_ok[j] = n < N;
        const int nn = n_ok[j] ? n : 0;
        w_src[j] = packed + ((size_t)(nn >> 4) * tiles * 2 + ((nn >> 3) & 1)) * 128 + (nn & 7) * 16;
        t_src[j] = terms + (size_t)(nn >> 4) * tiles * 16 + (nn & 7) * 2 + ((nn >> 3) & 1);
    }
    // Rows t and t + 128 of w_hat slot 0 (the same swizzle: 128 is a multiple of 8).
    unsigned char* const w_row = smem + W_OFFSET + t * SW128_ROW;
    const int r7 = t & 7;
    RingPos<WS> wc;              // the w_hat slot of the stage being converted
    RingPos<PS> pc, pi;          // the packed slots of the stage being converted and of the one being copied
    for (int kt = 0; kt < stages + PREFETCH; ++kt) {
        if (kt >= PREFETCH) {  // convert stage kt - PREFETCH
            cp_async_wait<PREFETCH - 1>();  // this thread's copies of that stage have landed
            const unsigned char* pr = smem + P_OFFSET + pc.slot * PACKED_BYTES;
            uint4 raw[2][2];
            uint32_t term[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int ch = t + PRODUCERS * j;
                raw[j][0] = *reinterpret_cast<const uint4*>(pr + ch * 32);
                raw[j][1] = *reinterpret_cast<const uint4*>(pr + ch * 32 + 16);
                term[j] = *reinterpret_cast<const uint32_t*>(pr + RAW_BYTES + ch * 4);
            }
            mbar_wait(bars + W_EMPTY + 8 * wc.slot, wc.phase ^ 1);  // the slot's previous stage retired
            unsigned char* wrow = w_row + wc.slot * W_BYTES;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int w = 0; w < 8; ++w) {  // lane t's words 0-3 (k 8w ..), then lane t + 1's
#ifdef FLLAMA_AWQ_TIMING_NO_DEQUANT  // timing only (wrong results): the stores without the conversion
                    const uint4 v = make_uint4(word(raw[j][w >> 2], w & 3), term[j], 0, 0);
#else
                    const uint4 v = awq_w_hat8(word(raw[j][w >> 2], w & 3), term[j]);
#endif
                    *reinterpret_cast<uint4*>(wrow + j * PRODUCERS * SW128_ROW + ((w ^ r7) << 4)) = v;
                }
            }
            fence_proxy_async();  // the w_hat stores, to the tensor cores
            mbar_arrive(bars + W_FULL + 8 * wc.slot);
            wc.next();
            pc.next();
        }
        if (kt < stages) {  // copy stage kt's packed words and terms
            unsigned char* pr = smem + P_OFFSET + pi.slot * PACKED_BYTES;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int ch = t + PRODUCERS * j;
                // tile kt / 2; lanes t = 2 (kt % 2) and + 1 hold its k's [64 (kt % 2), + 64): 32 contiguous bytes
                const uint32_t* w = w_src[j] + (size_t)(kt >> 1) * TILE_WORDS + (kt & 1) * 8;
                cp_async16(pr + ch * 32, w, n_ok[j]);
                cp_async16(pr + ch * 32 + 16, w + 4, n_ok[j]);
                cp_async4(pr + RAW_BYTES + ch * 4, t_src[j] + (size_t)(kt >> 1) * 16, n_ok[j]);
            }
            pi.next();
        }
        cp_async_commit();  // one group per iteration, empty past the last stage, so the waits count stages
    }
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
    const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t bars = smem_addr + BAR_OFFSET;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int stages = (K + BK - 1) / BK;
    if (tid == 0) {
        for (int s = 0; s < WS; ++s) {
            mbar_init(bars + W_FULL + 8 * s, PRODUCERS);  // every producer thread, after its own stores
            mbar_init(bars + W_EMPTY + 8 * s, 8);         // each consumer warp
        }
    }
    __syncthreads();
    pdl_wait();  // x and the residual come from the previous kernel
    if (wg == 0) {
        awq_wgmma_produce(smem, bars, packed, terms, N, stages, tiles, n0, tid);
        return;
    }
    const int cw = wg - 1, ct = tid - PRODUCERS * wg;  // consumer: tokens 64 cw .. + 63 of the block
    // Its x copies: rows 64 cw + ct / 8 + 16 i, 16-byte chunk ct % 8 (8 k) of the stage's 128 bytes.
    const int c = ct & 7, r0 = 64 * cw + (ct >> 3);
    const __half* x_row = x + (size_t)(m0 + r0) * K + 8 * c;  // read only where the row is below M
    uint32_t rows_ok = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) rows_ok |= (uint32_t)(m0 + r0 + 16 * i < M) << i;
    const uint32_t x_dst = sw128(r0, c);
    auto copy_x = [&](int kt, int slot) {
        unsigned char* xt = smem + slot * X_BYTES + x_dst;
        const int k = kt * BK;
        const bool k_ok = k + 8 * c < K;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool ok = k_ok && (rows_ok >> i & 1);
            cp_async16(xt + 16 * SW128_ROW * i, ok ? x_row + (size_t)16 * i * K + k : x, ok);
        }
    };
    float d[128];
    wgmma_pipeline_start<PREFETCH>(d, stages, [&](int kt) { copy_x(kt, kt); });
    RingPos<WS> wf;  // the stage's w_hat slot
    RingPos<XS> xs;  // and x slot
    int w_prev = 0;
    for (int kt = 0; kt < stages; ++kt) {
        cp_async_wait<PREFETCH - 1>();  // this thread's x copies of stage kt have landed
        fence_proxy_async();
        named_barrier(1 + cw, 128);     // and the warpgroup's
        mbar_wait(bars + W_FULL + 8 * wf.slot, wf.phase);
        const uint32_t sx = smem_addr + xs.slot * X_BYTES + cw * (64 * SW128_ROW);
        const uint32_t sw = smem_addr + W_OFFSET + wf.slot * W_BYTES;
        wgmma_stage<BK / 16>(d, sw128_desc(sx), sw128_desc(sw),
                             [](auto& acc, uint64_t a, uint64_t b) { wgmma_f16_m64n256k16(acc, a, b); });
        // stage kt - 1's wgmma retired (wgmma_stage waited for all but the newest group): its w_hat is free
        if (kt > 0 && lane == 0) mbar_arrive(bars + W_EMPTY + 8 * w_prev);
        w_prev = wf.slot;
        wf.next();
        const int xn = (xs.slot + PREFETCH) % XS;  // stage kt + PREFETCH's slot, stage kt - 2's before
        if (kt + PREFETCH < stages) copy_x(kt + PREFETCH, xn);
        cp_async_commit();
        xs.next();
    }
    wgmma_drain(d);
    pdl_launch_dependents();

    // Epilogue from the accumulators: rows m, m + 8; column pairs (n, n + 1).
    const int m = m0 + cw * 64 + (warp & 3) * 16 + (lane >> 2);
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
