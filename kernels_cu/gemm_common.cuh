// Device helpers of the GEMV/GEMM and attention kernels: streaming 16-byte loads, tensor-core mma.sync
// wrappers, byte permutes, and the magic-number int -> fp16 conversions (FasterTransformer's trick).
//
// Fragment layouts (PTX ISA, mma.sync.aligned .row.col; g = lane / 4, t = lane % 4):
//   m16n8k16 f16: A a0 (row g, k 2t..2t+1) a1 (row g+8, same k) a2 (row g, k 2t+8..) a3 (row g+8, k 2t+8..)
//                 B b0 (k 2t..2t+1, col g) b1 (k 2t+8.., col g)
//   m16n8k32 s8:  A a0 (row g, k 4t..4t+3) a1 (row g+8) a2 (row g, k 16+4t..) a3 (row g+8, k 16+4t..)
//                 B b0 (k 4t..4t+3, col g) b1 (k 16+4t.., col g)
//   C/D (both):   c0 c1 (row g, cols 2t, 2t+1)  c2 c3 (row g+8, cols 2t, 2t+1)
// A dot product does not care in which order its k terms come, so every kernel here hands the mma its
// k values in whatever order its 16-byte loads deliver them, as long as A and B use the same order.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "common.cuh"

namespace fllama {

// Loads with a guard folded into the instruction (zero when !ok): no branches, so the scheduler keeps
// every load of an unrolled step ahead of the first math that consumes one.
// Weights are read exactly once: keep them out of L1 so activations and scales stay there.
__device__ __forceinline__ uint4 ld_stream(const void* p, bool ok) {
    uint4 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)ok));
    return v;
}

// The same without the zero fill, for lanes whose results are thrown away when !ok (the register then
// holds whatever it held: it only ever feeds mma rows or columns that no lane writes out).
__device__ __forceinline__ uint4 ld_stream_unfilled(const void* p, bool ok) {
    uint4 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)ok));
    return v;
}

__device__ __forceinline__ uint2 ld_stream8(const void* p, bool ok) {
    uint2 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n"
        " mov.b32 %0, 0; mov.b32 %1, 0;\n"
        " @p ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n}\n"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "r"((int)ok));
    return v;
}

// Small operands that many warps re-read (activations, scales, zeros): the read-only cached path.
__device__ __forceinline__ uint4 ld_cached(const void* p, bool ok) {
    uint4 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n"
        " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"((int)ok));
    return v;
}

__device__ __forceinline__ uint2 ld_cached8(const void* p, bool ok) {
    uint2 v;
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n"
        " mov.b32 %0, 0; mov.b32 %1, 0;\n"
        " @p ld.global.nc.v2.u32 {%0, %1}, [%2];\n}\n"
        : "=r"(v.x), "=r"(v.y)
        : "l"(p), "r"((int)ok));
    return v;
}

// Unguarded and unfilled forms, for steps known to lie inside the operand (no predicate, no zero moves:
// the AWQ GEMV is issue-bound, and those would be a third of its instructions).
__device__ __forceinline__ uint4 ld_stream_always(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_cached8_always(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_cached_always(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// cp.async: 16 bytes global -> shared without a register round trip, so a warp keeps several tiles in
// flight while it computes. .cg skips L1 (weights are read once); src-size 0 writes zeros (ok false).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {  // at most PENDING groups of this thread still in flight
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// The W8A8 dequant epilogue (int8_gemm.cu, int8_wgmma.cu): two roundings in this order, like
// model_zoo.quant.int8.int8_gemm_ref; the residual is added after the fp16 rounding, as the reference model adds
// two fp16 tensors.
__device__ __forceinline__ __half int8_epilogue(int acc, float a_scale, float w_scale, const __half* residual) {
    const __half y = __float2half_rn(__fmul_rn(__fmul_rn((float)acc, a_scale), w_scale));
    return residual ? __hadd_rn(y, *residual) : y;
}

// The activation rows a lane feeds as the mma's B operand: token m0 + 8 mt + g of each of its MT token tiles,
// starting at element `offset` of the row. Rows past M point at row 0 and are flagged, so loads stay in bounds.
template <int MT, typename T>
__device__ __forceinline__ void token_rows(const T* x, int M, int K, int m0, int g, int offset, bool (&ok)[MT],
                                           const T* (&row)[MT]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = m0 + mt * 8 + g;
        ok[mt] = m < M;
        row[mt] = x + (size_t)(ok[mt] ? m : 0) * K + offset;
    }
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;  // i is always a compile-time constant
}

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// 2x2 transpose of fp16 pairs: (a.lo, b.lo) and (a.hi, b.hi).
__device__ __forceinline__ uint32_t pair_lo(uint32_t a, uint32_t b) { return prmt(a, b, 0x5410); }
__device__ __forceinline__ uint32_t pair_hi(uint32_t a, uint32_t b) { return prmt(a, b, 0x7632); }

template <uint32_t LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
    return d;
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 bits_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// ---- int4 (AutoAWQ packing) -> fp16 --------------------------------------------------------------
// AWQ packs column 8c + [0,2,4,6,1,3,5,7][i] into nibble i of word c, so nibbles (p, p+4) hold the
// adjacent columns (2p, 2p+1). (w & 0x000f000f) | 0x6400 6400 reads nibbles 0 and 4 as the halves
// 1024 + n; the mask 0x00f000f0 gives 1024 + 16 n (nibbles 1 and 5); w >> 8 repeats for 2/6 and 3/7.
constexpr uint32_t LOP3_AND_OR = (0xF0 & 0xCC) | 0xAA;  // (a & b) | c
constexpr uint32_t FP16_1024 = 0x64006400;
constexpr uint32_t FP16_960 = 0x63806380;
constexpr uint32_t FP16_ONE_SIXTEENTH = 0x2c002c00;

// Per group and packed zero word: the four fp16 pairs that turn the magic values into q - z exactly.
// Pairs 0 and 2 are subtracted (1024 + q) - (1024 + z); pairs 1 and 3 are added after the 1/16 scaling
// (64 + q) + (960 - (1024 + z)). Every intermediate is an integer below 2048: fp16 holds them exactly.
__device__ __forceinline__ void awq_zero_terms(uint32_t zw, __half2 (&zz)[4]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const __half2 zm = bits_h2(lop3<LOP3_AND_OR>(zw >> (4 * p), 0x000f000f, FP16_1024));  // 1024 + z
        zz[p] = (p & 1) ? __hsub2(bits_h2(FP16_960), zm) : zm;
    }
}

// One packed word -> the fp16 pairs w_hat = (q - z) * s of columns (0,1) (2,3) (4,5) (6,7):
// q - z is exact; the product with s rounds once in fp16, as the reference dequantizer does.
__device__ __forceinline__ void awq_dequant_word(uint32_t qw, const __half2 (&zz)[4], const uint4& s,
                                                 uint32_t (&out)[4]) {
    const uint32_t hi = qw >> 8;
    const __half2 q0 = bits_h2(lop3<LOP3_AND_OR>(qw, 0x000f000f, FP16_1024));
    const __half2 q1 = bits_h2(lop3<LOP3_AND_OR>(qw, 0x00f000f0, FP16_1024));
    const __half2 q2 = bits_h2(lop3<LOP3_AND_OR>(hi, 0x000f000f, FP16_1024));
    const __half2 q3 = bits_h2(lop3<LOP3_AND_OR>(hi, 0x00f000f0, FP16_1024));
    const __half2 sixteenth = bits_h2(FP16_ONE_SIXTEENTH);
    out[0] = h2_bits(__hmul2_rn(__hsub2(q0, zz[0]), bits_h2(s.x)));
    out[1] = h2_bits(__hmul2_rn(__hfma2(q1, sixteenth, zz[1]), bits_h2(s.y)));
    out[2] = h2_bits(__hmul2_rn(__hsub2(q2, zz[2]), bits_h2(s.z)));
    out[3] = h2_bits(__hmul2_rn(__hfma2(q3, sixteenth, zz[3]), bits_h2(s.w)));
}

// ---- int4 k-pairs (the AWQ GEMV) ------------------------------------------------------------------
// prmt(a, b, 0x5410) of the packed words of rows k (a) and k + 1 (b) puts a's nibbles 0-3 in the low half
// and b's nibbles 0-3 in the high half, so the same four LOP3 extractions give (row k, row k + 1) pairs of
// ONE column: extraction j -> column 2j (nibble j); prmt 0x7632 does nibbles 4-7 -> column 2j + 1. One
// prmt per word instead of four after the dequantization: pairs of one column along k are exactly what
// an mma A fragment holds. zz[j] and s[j] are column (2j or 2j + 1)'s zero term (awq_zero_terms' form for
// pair j) and scale, both halves equal; q - z is exact and the product with s rounds once, as before.
__device__ __forceinline__ void awq_dequant_kpairs(uint32_t kw, const __half2 (&zz)[4], const __half2 (&s)[4],
                                                   uint32_t (&out)[4]) {
    const uint32_t hi = kw >> 8;
    const __half2 q0 = bits_h2(lop3<LOP3_AND_OR>(kw, 0x000f000f, FP16_1024));
    const __half2 q1 = bits_h2(lop3<LOP3_AND_OR>(kw, 0x00f000f0, FP16_1024));
    const __half2 q2 = bits_h2(lop3<LOP3_AND_OR>(hi, 0x000f000f, FP16_1024));
    const __half2 q3 = bits_h2(lop3<LOP3_AND_OR>(hi, 0x00f000f0, FP16_1024));
    const __half2 sixteenth = bits_h2(FP16_ONE_SIXTEENTH);
    out[0] = h2_bits(__hmul2_rn(__hsub2(q0, zz[0]), s[0]));
    out[1] = h2_bits(__hmul2_rn(__hfma2(q1, sixteenth, zz[1]), s[1]));
    out[2] = h2_bits(__hmul2_rn(__hsub2(q2, zz[2]), s[2]));
    out[3] = h2_bits(__hmul2_rn(__hfma2(q3, sixteenth, zz[3]), s[3]));
}

// ---- int8 -> fp16 (exact) ------------------------------------------------------------------------
// Bias to unsigned (x ^ 0x80), place each byte under the exponent byte 0x64 (1024 + u), then subtract
// 1152 = 1024 + 128: the fp16 value of the signed byte. Natural byte order in, natural pairs out.
__device__ __forceinline__ void i8x4_to_h2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    const __half2 bias = bits_h2(0x64806480u);
    lo = h2_bits(__hsub2(bits_h2(prmt(u, 0x64646464u, 0x4140)), bias));  // bytes 0, 1
    hi = h2_bits(__hsub2(bits_h2(prmt(u, 0x64646464u, 0x4342)), bias));  // bytes 2, 3
}

// ---- the fp16 / int8 decode GEMV main loop ---------------------------------------------------------
// Block = WARPS warps on 16 output channels: mma rows g (weight rows lo_row + g) and g + 8 (hi_row + g), the
// warps splitting K in steps of UNROLL tiles of TILE_K (64 bytes of a row). Per tile lane (g, t) feeds the mma
// 16 bytes of rows g and g + 8 at byte 16 t of the tile and the same k's of each of its MT token rows (x_row[mt]
// already points at the lane's offset lane_k; 16 bytes, or 32 for fp16 x against int8 weights, GlobalX32);
// gemv_mma calls mma(acc[mt], a0, a1, a2, a3, x words) for the two k-halves of them (a0/a2 = words 0-1 of row g,
// then 2-3).
// The weights do not go to registers in that shape: a warp load of it covers half of 8 lines (8 rows x 64
// bytes), and such GEMVs reach 80-87% of the copy bandwidth where whole lines per instruction reach 93-97%.
// Each step is copied by cp.async as whole lines (quarter-warp q copies the
// 128-byte lines of rows 2q, 2q + 1, 8 + 2q, 9 + 2q, lane chunk lane & 7) into the warp's own stage of a ring
// in shared memory (GEMV_STAGES stages of 16 rows x UNROLL * 64 bytes, chunk c of odd rows stored at c ^ 4 so
// that the lanes of one 16-byte read phase, rows g and g + 1, hit 8 different bank groups), and each lane
// reads its tile fragments from there. Copies in flight hold no registers; the next GEMV_STAGES - 1 steps are
// in flight while one is computed, and the first ones are issued before pdl_wait() (weights depend on no
// earlier kernel). after_wait() runs right after the wait (the fp16 GEMV's deferred norm prefetches there,
// norm_fold.cuh). K % (16 bytes of T) == 0: a chunk is all in or all out (zero-filled).
constexpr int GEMV_STAGES = 2;  // gemm_shapes.GEMV_STAGES (a third stage gains nothing)
constexpr int GEMV_ROWS_PER_BLOCK = 16;

struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};
// Where the activations come from: global memory (read-only cached path), or shared memory that the block
// filled itself in its after-wait hook (int8_gemv's deferred quantization). A loader's load(p, ok) issues the
// lane's read for one tile (p = x_row[mt] + k) and returns a Raw value; finish(raw) turns that into the lane's 16
// bytes once the step's math is done, so a loader whose value needs work (int8_gemm.cu's RowQuantX: fp16
// quantized in the loop) does it after the read has had a whole step to land. Here Raw is the value itself.
// LOAD_FIRST: the first step's loads go out before after_wait() (whose own reads then share their round trip), where
// the hook does not fill what they read (SharedX's does).
struct GlobalX {
    static constexpr bool LOAD_FIRST = false;
    using Raw = uint4;
    using Value = uint4;
    __device__ __forceinline__ uint4 load(const void* p, bool ok) const { return ld_cached(p, ok); }
    __device__ __forceinline__ uint4 finish(uint4 r) const { return r; }
};
struct SharedX {
    static constexpr bool LOAD_FIRST = false;
    using Raw = uint4;
    using Value = uint4;
    __device__ __forceinline__ uint4 load(const void* p, bool ok) const {
        return ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ uint4 finish(uint4 r) const { return r; }
};
// fp16 activations against int8 weights (fp16_gemv.cu's w8a16 entries): a tile's 16 weight bytes of a lane are 16 k's,
// so its activations are 32 bytes, two halves of which go to each of the main loop's two mma steps (gemv_mma).
struct X32 {
    uint4 lo, hi;  // k's 0-7 / 8-15 of the lane's chunk
};
struct GlobalX32 {
    static constexpr bool LOAD_FIRST = false;
    using Raw = X32;
    using Value = X32;
    __device__ __forceinline__ X32 load(const void* p, bool ok) const {
        return {ld_cached(p, ok), ld_cached(static_cast<const uint8_t*>(p) + 16, ok)};
    }
    __device__ __forceinline__ X32 finish(X32 r) const { return r; }
};

// Step s (0, 1) of a tile: the mma of the lane's weight words 2 s, 2 s + 1 (a0-a3) with its activations. 16 bytes of
// x (fp16 or int8 weights of the same width as x): words 2 s, 2 s + 1 as b0, b1; 32 bytes (int8 weights, fp16 x):
// the 16 bytes of the same 8 k's.
template <typename Mma, typename Acc>
__device__ __forceinline__ void gemv_mma(Mma& mma, Acc& acc, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         const uint4& x, int s) {
    mma(acc, a0, a1, a2, a3, word(x, 2 * s), word(x, 2 * s + 1));
}
template <typename Mma, typename Acc>
__device__ __forceinline__ void gemv_mma(Mma& mma, Acc& acc, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         const X32& x, int s) {
    mma(acc, a0, a1, a2, a3, s ? x.hi : x.lo);
}

// Bytes of the ring (dynamic shared memory) for a block of WARPS warps.
template <int WARPS, int UNROLL>
__host__ __device__ constexpr int gemv_ring_bytes() {
    return WARPS * GEMV_STAGES * GEMV_ROWS_PER_BLOCK * UNROLL * 64;
}

template <int WARPS, int UNROLL, int TILE_K, int MT, typename T, typename X, typename Acc, typename Mma,
          typename AfterWait = NoHook, typename XLoad = GlobalX>
__device__ __forceinline__ void gemv_mainloop(const T* weight, int lo_row, int hi_row, int n_rows, uint8_t* ring,
                                              const X* const (&x_row)[MT], const bool (&x_ok)[MT], int K,
                                              int lane_k, int warp, int M, Acc (&acc)[MT][4], Mma mma,
                                              AfterWait after_wait = {}, XLoad x_load = {}) {
    static_assert(TILE_K * sizeof(T) == 64 && UNROLL % 2 == 0, "a pair of tiles is one 128-byte line");
    constexpr int ROW_BYTES = UNROLL * 64, STAGE_BYTES = GEMV_ROWS_PER_BLOCK * ROW_BYTES;
    constexpr int STRIDE = WARPS * UNROLL;
    const int tiles = (K + TILE_K - 1) / TILE_K;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint8_t* my_ring = ring + warp * GEMV_STAGES * STAGE_BYTES;

    // the copies: this lane's rows (mma rows 2q, 2q + 1, 8 + 2q, 9 + 2q) and its chunk of each line
    const int pair = 2 * (lane >> 3), chunk = lane & 7;
    const int chunk_k = chunk * (16 / (int)sizeof(T));
    const T* src[4];
    bool row_ok[4];
    uint32_t dst[4];  // shared-memory offset of the chunk in a stage (tile pair 0)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int mrow = (i < 2 ? 0 : 8) + pair + (i & 1);
        const int r = (i < 2 ? lo_row : hi_row) + pair + (i & 1);
        row_ok[i] = r < n_rows;
        src[i] = weight + (size_t)(row_ok[i] ? r : 0) * K + chunk_k;
        dst[i] = mrow * ROW_BYTES + 16 * (chunk ^ ((mrow & 1) << 2));
    }
    auto issue = [&](int base, int stage) {  // one step's lines into a stage, one commit group (empty past K)
        if (base < tiles) {
            uint8_t* st = my_ring + stage * STAGE_BYTES;
#pragma unroll
            for (int u = 0; u < UNROLL; u += 2) {
                const int k = (base + u) * TILE_K;
                const bool k_ok = k + chunk_k < K;
#pragma unroll
                for (int i = 0; i < 4; ++i) cp_async16(st + dst[i] + 64 * u, src[i] + k, k_ok && row_ok[i]);
            }
        }
        cp_async_commit();
    };
    // the fragments: rows g and g + 8 at byte 64 u + 16 t of the row = line u / 2, chunk 4 (u & 1) + t
    const int rd_lo = g * ROW_BYTES, rd_hi = (g + 8) * ROW_BYTES;
    auto frag = [&](const uint8_t* st, int row_off, int u) {
        const int c = (4 * (u & 1) + t) ^ ((g & 1) << 2);
        return *reinterpret_cast<const uint4*>(st + row_off + 128 * (u >> 1) + 16 * c);
    };
    using XRaw = typename XLoad::Raw;
    typename XLoad::Value xv[UNROLL][MT];
    auto load_x = [&](int base, XRaw (&xs)[UNROLL][MT]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = (base + u) * TILE_K;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) xs[u][mt] = x_load.load(x_row[mt] + k, k + lane_k < K && x_ok[mt]);
        }
    };
    auto finish_x = [&](XRaw (&xs)[UNROLL][MT]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) xv[u][mt] = x_load.finish(xs[u][mt]);
    };
#pragma unroll
    for (int s = 0; s < GEMV_STAGES - 1; ++s) issue(warp * UNROLL + s * STRIDE, s);
    pdl_wait();
    pdl_gemv_started(M);  // M: the GEMV's token rows (few: its dependents start now)
    {
        XRaw x0[UNROLL][MT];
        if constexpr (XLoad::LOAD_FIRST) {
            load_x(warp * UNROLL, x0);
            after_wait();
        } else {
            after_wait();
            load_x(warp * UNROLL, x0);
        }
        finish_x(x0);
    }
    int stage = 0;
    for (int base = warp * UNROLL; base < tiles; base += STRIDE) {
        issue(base + (GEMV_STAGES - 1) * STRIDE, (stage + GEMV_STAGES - 1) % GEMV_STAGES);
        XRaw nx[UNROLL][MT];
        load_x(base + STRIDE, nx);
        cp_async_wait<GEMV_STAGES - 1>();
        __syncwarp();  // the other lanes' copies of this stage have landed
        const uint8_t* st = my_ring + stage * STAGE_BYTES;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint4 wl = frag(st, rd_lo, u), wh = frag(st, rd_hi, u);
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    gemv_mma(mma, acc[mt], word(wl, 2 * s), word(wh, 2 * s), word(wl, 2 * s + 1), word(wh, 2 * s + 1),
                             xv[u][mt], s);
        }
        __syncwarp();  // every lane has read the stage before the next issue refills it
        finish_x(nx);
        stage = (stage + 1) % GEMV_STAGES;
    }
    cp_async_wait<0>();  // nothing of ours in flight when the block moves on (the fold's cp.async included)
    pdl_gemv_streamed();
}

}  // namespace fllama
