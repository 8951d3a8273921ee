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
// does this kernel's work for one new token per row inside attention_fused.cu.
// A token whose position is outside [0, max_pos) gets q = 0 and no cache write; one outside the cache
// (pos >= L or row outside [0, B)) gets its rotated q but no cache write.
//
// Thread f = (t * HB + b) * G + g, with G = d / 16 and HB = ceil(n_heads / n), handles elements [8g, 8g+8) and
// [d/2 + 8g, d/2 + 8g + 8) (the rotation pairs) of heads b, b + HB, ..., b + (n-1)*HB of token t: it issues all
// n heads' loads before any math (bytes in flight) and reads the token's pos, row and cos/sin slice once. Threads
// of consecutive b read consecutive heads (coalesced). For the 8-bit caches the G lanes of a head reduce their
// absmax with shuffles, so G must be a power of two (d in 16..512) and whole warps run every shuffle.
#include "rope.cuh"

using namespace fllama;

#define ROPE_THREADS 256   // rope_kv.py's THREADS
#define ROPE_MAX_HEADS 4   // rope_kv.py's MAX_HEADS_PER_THREAD: n <= this

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
    int nh, nkv, d, L, B, max_pos, T, n;
};

// This thread's token t, first head b and chunk g; live false past the last token (t clamped to 0).
struct RopeUnit {
    int t, b, g;
    bool live;
};

__device__ __forceinline__ RopeUnit rope_unit(const RopeArgs& a, int HB, int G) {
    const unsigned f = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned per_token = unsigned(HB * G);
    const unsigned t = f / per_token, rem = f - t * per_token;
    const bool live = t < unsigned(a.T);
    return {live ? int(t) : 0, int(rem / G), int(rem % G), live};
}

// Head j's chunk: q / k rotated (or zeroed when the position is outside the table), then q to q_out and
// k / v to the caches. Every lane calls it for every j < n (the 8-bit paths' shuffles).
template <int KV>
__device__ __forceinline__ void rope_store_head(const RopeArgs& a, const RopeUnit& w, int head, bool active,
                                                Half8& lo, Half8& hi, const __half2 (&c)[4], const __half2 (&s)[4],
                                                int p, int r, bool rot_ok, bool cache_ok) {
    const int G = a.d / 16, half_d = a.d / 2;
    if (active && head < a.nh + a.nkv) {
        if (rot_ok) {
            rotate8_h2(lo, hi, c, s);
        } else {
            lo.h[0] = lo.h[1] = lo.h[2] = lo.h[3] = __float2half2_rn(0.0f);
            hi = lo;
        }
    }
    if (active && head < a.nh) {
        __half* dst = a.q_out + ((size_t)w.t * a.nh + head) * a.d;
        store_half8(dst + 8 * w.g, lo);
        store_half8(dst + half_d + 8 * w.g, hi);
    }
    const bool is_v = head >= a.nh + a.nkv;
    const int kvh = is_v ? head - a.nh - a.nkv : head - a.nh;
    const size_t slot = ((size_t)r * a.nkv + kvh) * a.L + p;  // cache (row, head, position)
    const bool write = active && head >= a.nh && cache_ok;
    if constexpr (KV == KV_F16) {
        if (write) store_head_f16(a.k_cache, a.v_cache, is_v, slot, a.d, half_d, lo, hi, w.g);
    } else {
        const float m = head_absmax(lo, hi, active, G);
        if (write)
            store_head_q8<KV>(a.k_cache, a.v_cache, a.k_scale, a.v_scale, is_v, slot, a.d, half_d, lo, hi, m, w.g);
    }
}

template <int KV>
__device__ __forceinline__ void rope_kv_heads(const RopeArgs& a) {
    const int G = a.d / 16, half_d = a.d / 2;
    const int n_heads = a.nh + 2 * a.nkv;
    const int HB = (n_heads + a.n - 1) / a.n;
    const RopeUnit w = rope_unit(a, HB, G);
    const __half* src = a.qkv + (size_t)w.t * n_heads * a.d + 8 * w.g;
    Half8 lo[ROPE_MAX_HEADS], hi[ROPE_MAX_HEADS];
#pragma unroll
    for (int j = 0; j < ROPE_MAX_HEADS; ++j) {
        const int head = w.b + j * HB;
        if (w.live && j < a.n && head < n_heads) {
            lo[j] = load_half8(src + (size_t)head * a.d);
            hi[j] = load_half8(src + (size_t)head * a.d + half_d);
        }
    }
    const int p = w.live ? a.pos[w.t] : -1, r = w.live ? a.row[w.t] : 0;
    const bool rot_ok = p >= 0 && p < a.max_pos;
    const bool cache_ok = rot_ok && p < a.L && r >= 0 && r < a.B;
    __half2 c[4], s[4];
    if (rot_ok) {
        const float* cs = a.cos_sin + (size_t)p * a.d + 8 * w.g;
        load_cos_sin_h2(cs, c);
        load_cos_sin_h2(cs + half_d, s);
    }
#pragma unroll
    for (int j = 0; j < ROPE_MAX_HEADS; ++j) {
        if (j >= a.n) break;  // n is the grid's: uniform
        const int head = w.b + j * HB;
        rope_store_head<KV>(a, w, head, w.live && head < n_heads, lo[j], hi[j], c, s, p, r, rot_ok, cache_ok);
    }
}

#define FLLAMA_ROPE_ENTRY(NAME, KV)                                                                         \
    extern "C" __global__ void __launch_bounds__(ROPE_THREADS)                                              \
        NAME(__half* q_out, void* k_cache, void* v_cache, float* k_scale, float* v_scale, const __half* qkv, \
             const float* cos_sin, const int* pos, const int* row, int nh, int nkv, int d, int L, int B,     \
             int max_pos, int T, int n) {                                                                   \
        pdl_enter();                                                                                        \
        const RopeArgs a{q_out, k_cache, v_cache, k_scale, v_scale, qkv, cos_sin, pos, row,                 \
                         nh, nkv, d, L, B, max_pos, T, n};                                                  \
        rope_kv_heads<KV>(a);                                                                               \
    }

FLLAMA_ROPE_ENTRY(rope_kv_f16, KV_F16)
FLLAMA_ROPE_ENTRY(rope_kv_i8, KV_I8)
FLLAMA_ROPE_ENTRY(rope_kv_f8, KV_F8)
