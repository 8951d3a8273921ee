// RoPE on q and k from the fused QKV output, fused with the KV-cache write.
//
//   qkv      fp16 [T, (nh + 2*nkv) * d]        heads in order q0..q(nh-1), k0..k(nkv-1), v0..v(nkv-1)
//   cos_sin  fp32 [max_pos, d]                 row p = cos(p*f_0 .. p*f_{d/2-1}), sin(same)
//   pos,row  int32 [T]                         position and cache row of each token (device: graphs reuse them)
//   q_out    fp16 [T, nh, d]                   rotated q
//   caches   [B, nkv, L, d]                    fp16, or int8 / e4m3 codes with fp32 scales [B, nkv, L]
//                                              (kv_codes.cuh: absmax over d / 127, or / 448)
//
// Numerics are transformers' (non-interleaved, rotate_half): cos/sin rounded to fp16, then
// x*cos + rotate_half(x)*sin with every multiply and add rounded to fp16 (_rn: no FMA contraction). The
// arithmetic and the cache store live in rope.cuh, shared with the decode attention's RoPE mode, which
// does this kernel's work for one new token per row inside attention_decode.cu.
// A token whose position is outside [0, max_pos) gets q = 0 and no cache write; one outside the cache
// (pos >= L or row outside [0, B)) gets its rotated q but no cache write.
//
// One block per token; thread unit u = head * G + g with G = d / 16 handles elements [8g, 8g+8) and
// [d/2 + 8g, d/2 + 8g + 8) of one head (the rotation pairs). For the 8-bit caches the G lanes of a head
// reduce their absmax with shuffles, so G must be a power of two (d in 16..512).
#include "rope.cuh"

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

template <int KV>
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

    // Every thread runs every iteration so the 8-bit paths' shuffles see full warps.
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
        if constexpr (KV == KV_F16) {
            if (write) store_head_f16(a.k_cache, a.v_cache, is_v, slot, a.d, half_d, lo, hi, g);
        } else {
            const float m = head_absmax(lo, hi, active, G);
            if (write)
                store_head_q8<KV>(a.k_cache, a.v_cache, a.k_scale, a.v_scale, is_v, slot, a.d, half_d, lo, hi, m, g);
        }
    }
}

#define FLLAMA_ROPE_ENTRY(NAME, KV)                                                                         \
    extern "C" __global__ void __launch_bounds__(1024)                                                      \
        NAME(__half* q_out, void* k_cache, void* v_cache, float* k_scale, float* v_scale, const __half* qkv, \
             const float* cos_sin, const int* pos, const int* row, int nh, int nkv, int d, int L, int B,     \
             int max_pos) {                                                                                 \
        pdl_enter();                                                                                        \
        const RopeArgs a{q_out, k_cache, v_cache, k_scale, v_scale, qkv, cos_sin, pos, row,                 \
                         nh, nkv, d, L, B, max_pos};                                                        \
        rope_kv_token<KV>(a);                                                                               \
    }

FLLAMA_ROPE_ENTRY(rope_kv_f16, KV_F16)
FLLAMA_ROPE_ENTRY(rope_kv_i8, KV_I8)
FLLAMA_ROPE_ENTRY(rope_kv_f8, KV_F8)
