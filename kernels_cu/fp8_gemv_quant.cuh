// The self-quantizing fp8 GEMVs' prologue hooks and activation loaders (fp8_gemm.cu: the xq / nq entries and
// their one-row forms): each row's scale found after the PDL wait, and the lanes' fp16 values turned into their e4m3
// codes as exact fp16 values in the main loop (fp8_quantize's and rmsnorm.cu's arithmetic, bit for bit).
#pragma once

#include "fp8_common.cuh"

namespace fllama {

constexpr int FP8_GEMV_WARPS = 8;  // fp8_gemm.cu's blocks: the hooks' per-warp reductions

// Each of the block's rows' max from its warps' maxima (s_red [8][FP8_GEMV_WARPS], thread r < rows takes row r),
// then the row's scale and its inverse (fp8_quantize's rule).
__device__ __forceinline__ void rows_dyn_scales(const float* s_red, float* s_inv, float* s_scale, int rows) {
    const int tid = threadIdx.x;
    if (tid < rows) {
        float amax = 0.0f;
#pragma unroll
        for (int w = 0; w < FP8_GEMV_WARPS; ++w) amax = fmaxf(amax, s_red[tid * FP8_GEMV_WARPS + w]);
        fp8_dyn_scales(amax, s_inv[tid], s_scale[tid]);
    }
}

// fp8_gemv_xq's prologue, right after the PDL wait: each of the block's rows' scales (fp8_quantize's rule) into
// s_scale[row] for the epilogue, and the scale's inverse of this lane's token row g into *inv for Fp8QuantX. The rows
// are read as one flat range (x is contiguous), NV 16-byte loads a thread in flight, each folded into its row's
// running max (the row selected in an unrolled loop, so a[] stays in registers); static: the stored scale.
struct Fp8AmaxHook {
    float* inv;      // the lane's token row's 1 / a_scale (a local of the kernel: a register after inlining)
    float* s_scale;  // [8] shared: a_scale of each row
    float* s_inv;    // [8] shared
    float* s_red;    // [8][FP8_GEMV_WARPS] shared
    const __half* x;
    const float* static_scale;
    int m0, rows, K, g;

    __device__ __forceinline__ void operator()() const {
        constexpr int NV = 8, THREADS = 32 * FP8_GEMV_WARPS;
        const int tid = threadIdx.x;
        if (static_scale != nullptr) {
            float i, sc;
            fp8_static_scales(*static_scale, i, sc);
            *inv = i;
            if (tid < rows) s_scale[tid] = sc;  // read after the epilogue's barrier
            return;
        }
        const int n8 = K / 8, total = rows * n8;  // 8-value chunks of the block's rows
        const __half* x0 = x + (size_t)m0 * K;
        float a[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) a[r] = 0.0f;
        for (int base = 0; base < total; base += NV * THREADS) {
            Half8 v[NV];
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = base + tid + j * THREADS;
                if (c < total) v[j] = load_half8(x0 + (size_t)8 * c);
            }
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int c = base + tid + j * THREADS;
                if (c >= total) continue;
                const float m = half8_absmax(v[j]);
                if (rows == 1) {  // block-uniform
                    a[0] = fmaxf(a[0], m);
                } else {
                    const int row = c / n8;
#pragma unroll
                    for (int r = 0; r < 8; ++r) a[r] = row == r ? fmaxf(a[r], m) : a[r];
                }
            }
        }
        warp_rows_max_store<FP8_GEMV_WARPS>(a, rows, s_red);
        __syncthreads();
        rows_dyn_scales(s_red, s_inv, s_scale, rows);
        __syncthreads();
        *inv = g < rows ? s_inv[g] : 0.0f;
    }
};

// fp8_gemv_xq's activations: the lane's 16 fp16 values of a tile (32 bytes, GlobalX32's reads), each pair turned into
// the exact fp16 values of its e4m3 codes once the step's math is done (finish).
struct Fp8QuantX {
    static constexpr bool LOAD_FIRST = false;  // the hook must have found inv first
    using Raw = X32;
    using Value = X32;
    const float* inv;

    __device__ __forceinline__ X32 load(const void* p, bool ok) const {
        return {ld_cached(p, ok), ld_cached(static_cast<const uint8_t*>(p) + 16, ok)};
    }
    __device__ __forceinline__ X32 finish(X32 r) const {
        const float s = *inv;
        r.lo = make_uint4(fp8_fake_quant2(r.lo.x, s), fp8_fake_quant2(r.lo.y, s), fp8_fake_quant2(r.lo.z, s),
                          fp8_fake_quant2(r.lo.w, s));
        r.hi = make_uint4(fp8_fake_quant2(r.hi.x, s), fp8_fake_quant2(r.hi.y, s), fp8_fake_quant2(r.hi.z, s),
                          fp8_fake_quant2(r.hi.w, s));
        return r;
    }
};

// fp8_gemv_nq's prologue: the RMSNorm of the block's rows, then their scales. Row r's sum of squares in
// rmsnorm_plain_nv<nv>'s order with `vt` threads (row_launch's; vt <= 256): virtual thread v < vt adds chunks
// v + j vt, j < nv, by fmaf in order, then rmsnorm's block_sum (a butterfly per warp, the warps' sums in lanes < 8,
// zeros beyond, a butterfly again; the warps past vt / 32 add zeros, which changes no bit), then its rinv. The max
// |y| of the row's y = w * fp16(h * rinv) gives the scales (fp8_quantize's rule on the norm kernel's output).
struct Fp8NormHook {
    float* rinv;     // the lane's token row's 1 / rms (a register after inlining)
    float* inv;      // ... and its 1 / a_scale
    float* s_scale;  // [8] shared: a_scale of each row
    float* s_inv;    // [8] shared
    float* s_rinv;   // [8] shared
    float* s_red;    // [8][FP8_GEMV_WARPS] shared
    const __half* h;
    const __half* nw;
    const float* static_scale;
    float eps;
    int vt, nv, m0, rows, K, g;

    __device__ __forceinline__ void operator()() const {
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_vec = K / 8;
        for (int r = 0; r < rows; ++r) {  // block-uniform
            const __half* hr = h + (size_t)(m0 + r) * K;
            float s = 0.0f;
            if (tid < vt) {
                for (int j = 0; j < nv; ++j) {
                    const int c = tid + j * vt;
                    if (c < n_vec) {
                        const Half8 v = load_half8(hr + 8 * c);
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            const float f = half8_get(v, i);
                            s = __fmaf_rn(f, f, s);
                        }
                    }
                }
            }
            s = warp_sum(s);
            if (lane == 0) s_red[warp] = s;
            __syncthreads();
            const float total = warp_sum(lane < FP8_GEMV_WARPS ? s_red[lane] : 0.0f);
            if (tid == 0) s_rinv[r] = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)K), eps)));
            __syncthreads();  // s_rinv[r] for all; s_red free for the next row
        }
        if (static_scale == nullptr) {
            for (int r = 0; r < rows; ++r) {  // block-uniform
                const __half* hr = h + (size_t)(m0 + r) * K;
                const float ri = s_rinv[r];
                float m = 0.0f;
                for (int c = tid; c < n_vec; c += 32 * FP8_GEMV_WARPS) {
                    const Half8 v = load_half8(hr + 8 * c), w = load_half8(nw + 8 * c);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const __half y = __hmul_rn(half8_geth(w, i), __float2half_rn(__fmul_rn(half8_get(v, i), ri)));
                        m = fmaxf(m, fabsf(__half2float(y)));
                    }
                }
                m = warp_max(m);
                if (lane == 0) s_red[r * FP8_GEMV_WARPS + warp] = m;
            }
            __syncthreads();
            rows_dyn_scales(s_red, s_inv, s_scale, rows);
        } else if (tid < rows) {
            fp8_static_scales(*static_scale, s_inv[tid], s_scale[tid]);
        }
        __syncthreads();
        const int gr = g < rows ? g : 0;
        *inv = s_inv[gr];
        *rinv = s_rinv[gr];
    }
};

// fp8_gemv_nq's activations: the lane's 16 values of h and of the norm weight a tile, turned into y = w * fp16(h *
// rinv) (rmsnorm.cu's two roundings) and then into the exact fp16 values of y's e4m3 codes once the step's math is
// done.
struct Fp8NormQuantX {
    static constexpr bool LOAD_FIRST = false;  // the hook must have found rinv and inv first
    struct Raw {
        X32 h, w;
    };
    using Value = X32;
    const __half* row;  // the lane's token row of h (its x_row points into it)
    const __half* nw;
    const float* rinv;
    const float* inv;

    __device__ __forceinline__ Raw load(const void* p, bool ok) const {
        const __half* w = nw + (static_cast<const __half*>(p) - row);
        return {{ld_cached(p, ok), ld_cached(static_cast<const uint8_t*>(p) + 16, ok)},
                {ld_cached(w, ok), ld_cached(w + 8, ok)}};
    }
    __device__ __forceinline__ uint32_t y2(uint32_t h2, uint32_t w2) const {
        const float2 f = __half22float2(bits_h2(h2));
        const float ri = *rinv;
        const __half2 normed = __floats2half2_rn(__fmul_rn(f.x, ri), __fmul_rn(f.y, ri));
        return fp8_fake_quant2(h2_bits(__hmul2_rn(bits_h2(w2), normed)), *inv);
    }
    __device__ __forceinline__ X32 finish(const Raw& r) const {
        X32 o;
        o.lo = make_uint4(y2(r.h.lo.x, r.w.lo.x), y2(r.h.lo.y, r.w.lo.y), y2(r.h.lo.z, r.w.lo.z),
                          y2(r.h.lo.w, r.w.lo.w));
        o.hi = make_uint4(y2(r.h.hi.x, r.w.hi.x), y2(r.h.hi.y, r.w.hi.y), y2(r.h.hi.z, r.w.hi.z),
                          y2(r.h.hi.w, r.w.hi.w));
        return o;
    }
};

// One row (fp8_gemv_xq1*): lane (g, t) reads fp16 values 16 t + 2 g, +1 of a tile (p is its 16-value chunk; the 32
// lanes read one 128-byte run) and quantizes that pair (fp8_fake_quant2, Fp8QuantX's bits); word j of chunk t is
// lane 4 j + t's pair, gathered by shuffles into every lane of that t. inv: row 0's, in every lane (the hook's g 0).
__device__ __forceinline__ X32 gather_chunk(uint32_t mine, int t) {
    X32 v;
    v.lo = make_uint4(__shfl_sync(FULL_MASK, mine, t), __shfl_sync(FULL_MASK, mine, 4 + t),
                      __shfl_sync(FULL_MASK, mine, 8 + t), __shfl_sync(FULL_MASK, mine, 12 + t));
    v.hi = make_uint4(__shfl_sync(FULL_MASK, mine, 16 + t), __shfl_sync(FULL_MASK, mine, 20 + t),
                      __shfl_sync(FULL_MASK, mine, 24 + t), __shfl_sync(FULL_MASK, mine, 28 + t));
    return v;
}

struct Fp8RowQuantX {
    static constexpr bool LOAD_FIRST = true;  // the read needs no scale: in flight with the hook's reads
    using Raw = uint32_t;                     // the lane's two fp16 values
    using Value = X32;
    const float* inv;
    int g, t;

    __device__ __forceinline__ uint32_t load(const void* p, bool ok) const {
        return ok ? __ldg(reinterpret_cast<const unsigned*>(static_cast<const __half*>(p) + 2 * g)) : 0u;
    }
    __device__ __forceinline__ X32 finish(uint32_t r) const { return gather_chunk(fp8_fake_quant2(r, *inv), t); }
};

// One row of an RMSNorm's input (fp8_gemv_nq1*): the same spread, each lane's pair of h and of the norm weight turned
// into y's codes by Fp8NormQuantX::y2 (its bits).
struct Fp8NormRowQuantX {
    static constexpr bool LOAD_FIRST = true;
    struct Raw {
        uint32_t h, w;
    };
    using Value = X32;
    Fp8NormQuantX q;  // row = h (x_row's origin), nw, rinv, inv
    int g, t;

    __device__ __forceinline__ Raw load(const void* p, bool ok) const {
        const size_t i = static_cast<size_t>(static_cast<const __half*>(p) - q.row) + 2 * g;
        if (!ok) return {0u, 0u};
        return {__ldg(reinterpret_cast<const unsigned*>(q.row + i)),
                __ldg(reinterpret_cast<const unsigned*>(q.nw + i))};
    }
    __device__ __forceinline__ X32 finish(const Raw& r) const { return gather_chunk(q.y2(r.h, r.w), t); }
};
}  // namespace fllama
