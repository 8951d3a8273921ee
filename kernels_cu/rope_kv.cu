// RoPE on q and k from the fused QKV output, fused with the KV-cache write.
//
//   qkv      fp16 [T, (nh + 2*nkv) * d]        heads in order q0..q(nh-1), k0..k(nkv-1), v0..v(nkv-1)
//   cos_sin  fp32 [max_pos, d]                 row p = cos(p*f_0 .. p*f_{d/2-1}), sin(same)
//   pos,row  int32 [T]                         position and cache row of each token (device: graphs reuse them)
//   q_out    fp16 [T, nh, d]                   rotated q
//   caches   [B, nkv, L, d]                    fp16, or int8 with fp32 scales [B, nkv, L] (absmax over d / 127)
//
// Numerics are transformers' (non-interleaved, rotate_half): cos/sin rounded to fp16, then
// x*cos + rotate_half(x)*sin with every multiply and add rounded to fp16 (_rn: no FMA contraction).
// A token whose position is outside [0, max_pos) gets q = 0 and no cache write; one outside the cache
// (pos >= L or row outside [0, B)) gets its rotated q but no cache write.
//
// One block per token; thread unit u = head * G + g with G = d / 16 handles elements [8g, 8g+8) and
// [d/2 + 8g, d/2 + 8g + 8) of one head (the rotation pairs). For the int8 cache the G lanes of a head
// reduce their absmax with shuffles, so G must be a power of two (d in 16..512).
#include "common.cuh"

using namespace fllama;

struct RopeArgs {
    __half* q_out;
    void* k_cache;
    void* v_cache;
    float* k_scale;
    float* v_scale;
    const __half* qkv;
    const float* cos_sin;
    const int* pos;
    const int* row;
    int nh, nkv, d, L, B, max_pos;
};

__device__ __forceinline__ void load_cos_sin8(const float* p, __half (&out)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = __float2half_rn(a.x); out[1] = __float2half_rn(a.y);
    out[2] = __float2half_rn(a.z); out[3] = __float2half_rn(a.w);
    out[4] = __float2half_rn(b.x); out[5] = __float2half_rn(b.y);
    out[6] = __float2half_rn(b.z); out[7] = __float2half_rn(b.w);
}

// (lo, hi) = (x1, x2) halves of one head -> (x1*c - x2*s, x2*c + x1*s), each op rounded to fp16.
__device__ __forceinline__ void rotate8(Half8& lo, Half8& hi, const float* cs_row, int g, int half_d) {
    __half c[8], s[8];
    load_cos_sin8(cs_row + 8 * g, c);
    load_cos_sin8(cs_row + half_d + 8 * g, s);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __half x1 = half8_geth(lo, i), x2 = half8_geth(hi, i);
        half8_set(lo, i, __hsub_rn(__hmul_rn(x1, c[i]), __hmul_rn(x2, s[i])));
        half8_set(hi, i, __hadd_rn(__hmul_rn(x2, c[i]), __hmul_rn(x1, s[i])));
    }
}

template <bool INT8>
__device__ __forceinline__ void rope_kv_token(const RopeArgs& a) {
    const int t = blockIdx.x;
    const int G = a.d / 16, half_d = a.d / 2;
    const int n_heads = a.nh + 2 * a.nkv;
    const int units = n_heads * G;
    const int p = a.pos[t], r = a.row[t];
    const bool rot_ok = p >= 0 && p < a.max_pos;
    const bool cache_ok = rot_ok && p < a.L && r >= 0 && r < a.B;
    const __half* src_tok = a.qkv + (size_t)t * n_heads * a.d;
    const float* cs_row = a.cos_sin + (size_t)(rot_ok ? p : 0) * a.d;

    // Every thread runs every iteration so the int8 path's shuffles see full warps.
    for (int base = 0; base < units; base += blockDim.x) {
        const int u = base + threadIdx.x;
        const bool active = u < units;
        const int head = active ? u / G : 0, g = active ? u % G : 0;
        Half8 lo, hi;
        const __half* src = src_tok + (size_t)head * a.d;
        if (active) {
            lo = load_half8(src + 8 * g);
            hi = load_half8(src + half_d + 8 * g);
            if (head < a.nh + a.nkv) {
                if (rot_ok) {
                    rotate8(lo, hi, cs_row, g, half_d);
                } else {
                    lo.h[0] = lo.h[1] = lo.h[2] = lo.h[3] = __float2half2_rn(0.0f);
                    hi = lo;
                }
            }
        }
        if (active && head < a.nh) {
            __half* dst = a.q_out + ((size_t)t * a.nh + head) * a.d;
            store_half8(dst + 8 * g, lo);
            store_half8(dst + half_d + 8 * g, hi);
        }
        const bool is_v = head >= a.nh + a.nkv;
        const int kvh = is_v ? head - a.nh - a.nkv : head - a.nh;
        const size_t slot = ((size_t)r * a.nkv + kvh) * a.L + p;  // cache (row, head, position)
        const bool write = active && head >= a.nh && cache_ok;
        if (!INT8) {
            if (write) {
                __half* dst = static_cast<__half*>(is_v ? a.v_cache : a.k_cache) + slot * a.d;
                store_half8(dst + 8 * g, lo);
                store_half8(dst + half_d + 8 * g, hi);
            }
        } else {
            float m = active ? fmaxf(half8_absmax(lo), half8_absmax(hi)) : 0.0f;
            for (int o = G / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
            if (write) {
                const float amax = clamp_amax(m);
                const float inv = __fdiv_rn(127.0f, amax);
                int8_t* dst = static_cast<int8_t*>(is_v ? a.v_cache : a.k_cache) + slot * a.d;
                quantize_store8(dst + 8 * g, lo, inv);
                quantize_store8(dst + half_d + 8 * g, hi, inv);
                if (g == 0) (is_v ? a.v_scale : a.k_scale)[slot] = __fdiv_rn(amax, 127.0f);
            }
        }
    }
}

#define FLLAMA_ROPE_ENTRY(NAME, INT8)                                                                       \
    extern "C" __global__ void __launch_bounds__(1024)                                                      \
        NAME(__half* q_out, void* k_cache, void* v_cache, float* k_scale, float* v_scale, const __half* qkv, \
             const float* cos_sin, const int* pos, const int* row, int nh, int nkv, int d, int L, int B,     \
             int max_pos) {                                                                                 \
        pdl_enter();                                                                                        \
        const RopeArgs a{q_out, k_cache, v_cache, k_scale, v_scale, qkv, cos_sin, pos, row,                 \
                         nh, nkv, d, L, B, max_pos};                                                        \
        rope_kv_token<INT8>(a);                                                                             \
    }

FLLAMA_ROPE_ENTRY(rope_kv_f16, false)
FLLAMA_ROPE_ENTRY(rope_kv_i8, true)
