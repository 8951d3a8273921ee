// The candidates of sampling.cu's top-k / top-p draw: a radix select (8-bit digits, shared-memory histograms)
// finds the bin of the k-th largest key, digit by digit until that bin and the keys above it fit CAND_CAP (one or two
// digits, typically), then every token at or above the bin is gathered (with the softmax mass of the whole row, per
// 8,192-token segment, which the temperature-only draw also uses); the draw cuts the sorted candidates at the k-th.
// Over one block, or over a thread-block cluster of P blocks (sm_90), each block walking its own segments: per
// digit the P histograms are summed by every block (each reads the others' over distributed shared memory and picks
// the same digit), and the candidates and segment sums are pushed into block 0, which sorts and draws alone.
// Integer counts and per-segment float sums make the result the one-block kernel's, bit for bit, for any P.
#pragma once

#include "block_reduce.cuh"
#include "sample_values.cuh"

namespace fllama {

constexpr int CLUSTER_MAX = 16;  // blocks per cluster of the _cl entries (non-portable above 8; H100 / H200: 16)
constexpr int MAX_K = 1024;
constexpr int CAND_CAP = 2048;
constexpr int SEG_CAP = 64;   // segments of a cluster's row: V <= 524,288, sampling.py's CLUSTER_MAX_VOCAB
constexpr int SEG_MAX = 256;  // segments of any row (block 0 holds every sum): V <= 2,097,152, sampling.py's
                              // MAX_VOCAB
constexpr int SEG_GROUP = 32; // segments whose per-warp partials a block holds at once

struct SelectShared {
    int hist[2][256];  // this block's histogram; two, so a block fills digit j+1's while others still read j's
    int sum[256];      // the cluster's histogram (P > 1)
    unsigned long long cand[CAND_CAP];  // (key << 32) | ~token, block 0's
    float segw[SEG_GROUP * 32];         // a segment's per-warp sums
    float seg[SEG_MAX];                 // segment sums, in block 0
    float win_v, z_full;
    int win_i, n_cand, n_nan, remaining, tie, greater;
    uint32_t digit;
    bool done, fits;
};

// Warp 0 picks the bin holding the `remaining`-th largest key among 256 bins (descending order).
__device__ void choose_digit(const int* hist, SelectShared& sh) {
    const int lane = threadIdx.x & 31;
    int cnt[8], local = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        cnt[j] = hist[255 - (lane * 8 + j)];
        local += cnt[j];
    }
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += n;
    }
    int above = incl - local;  // keys in bins above this lane's 8 bins
    const int need = sh.remaining;
    __syncwarp();  // every lane has read `remaining` before the chosen lane overwrites it (racecheck)
    if (above < need && need <= incl) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (above < need && need <= above + cnt[j]) {
                sh.digit = 255 - (lane * 8 + j);
                sh.remaining = need - above;
                sh.tie = cnt[j];
                sh.done = cnt[j] == need - above;  // the whole bin is taken: lower digits need not be resolved
                // the bin and every key above it fit: decided here, where the counts are (the same test on k in
                // radix_select's loop made the f16_cl entry spill 36 bytes at its 64-register cap)
                sh.fits = sh.greater + above + cnt[j] <= CAND_CAP;
                sh.greater += above;
            }
            above += cnt[j];
        }
    }
}

// What a pass counts: keys with (key & mh) == ph, and (LOW) among them those whose ~token matches pl under ml.
struct Prefix {
    uint32_t ph, mh, pl, ml;
};

// Pass `pass`'s histogram and the cluster's sum cleared, before a barrier. Pass 0's is filled by the max pass
// (sampling.cu: every token counts, one walk of the row fewer).
__device__ __forceinline__ void clear_hist(SelectShared& sh, int pass) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        sh.hist[pass & 1][i] = 0;
        sh.sum[i] = 0;
    }
}

// One digit over the P blocks of the row's cluster (P == 1: this block alone): this block's segments histogrammed
// (one shared-memory atomic a key: merging a warp's adds to one bin by __match_any_sync measured slower, H200;
// walk false: hist[0] is already the first digit's), the blocks' histograms summed, the digit chosen into sh.
// The prefix's keys are one range, so a token whose penalized logit is outside its logit_bounds skips the division
// and the key (most tokens from the second digit on); the rest take a predicated atomic (a warp vote a token ahead
// of it made the one-block kernel's passes ~25% more instructions).
template <bool LOW, typename T, bool PEN>
__device__ void select_pass(const Row<T, PEN>& row, int V, int s_lo, int s_hi, int P, Prefix q, int shift, int pass,
                            bool walk, SelectShared& sh) {
    int* hist = sh.hist[pass & 1];
    if (walk) {
        clear_hist(sh, pass);
        const LogitBounds lb = logit_bounds(q.ph, q.ph | ~q.mh, row.inv_temp_div, row.scaled);
        __syncthreads();
        for_each_segment(row, V, s_lo, s_hi, [&](int v, float l, bool ok) {
            if (!ok) return;
            l = row.penalized(v, l);
            if (l <= lb.lo || l >= lb.hi) return;  // outside the prefix's keys
            const uint32_t key = float_key(row.scale(l)), iv = 0xffffffffu - (uint32_t)v;
            if ((key & q.mh) == q.ph && (!LOW || (iv & q.ml) == q.pl))
                atomicAdd(&hist[((LOW ? iv : key) >> shift) & 255u], 1);
        }, [](int) {});
    }
    if (P > 1) {
        cluster_sync();  // every block's histogram is complete (release / acquire)
        // 4 threads a bin, each adding up to 4 blocks' counts, their loads in flight together
        const int bin = threadIdx.x & 255, r0 = threadIdx.x >> 8;
        int total = 0;
#pragma unroll
        for (int j = 0; j < CLUSTER_MAX / 4; ++j)
            if (r0 + 4 * j < P) total += *cluster_ptr(hist + bin, r0 + 4 * j);
        if (total != 0) atomicAdd(&sh.sum[bin], total);
    }
    __syncthreads();
    if (threadIdx.x < 32) choose_digit(P > 1 ? sh.sum : hist, sh);
    __syncthreads();
}

// The candidates' bound: a token is one when key > hi, or key == hi and ~token >= lo. passes: digits run.
struct Threshold {
    uint32_t hi, lo;
    int passes;
};

// A bound on the k-th largest key: keys >= it are the top k, the ties with the k-th, and, where the digit that
// placed the k-th key leaves at most CAND_CAP keys at or above its bin, the rest of that bin (sampling.cu's draw
// keeps the top k and their ties of the sorted candidates). Where the ties with the k-th would overflow CAND_CAP,
// the select goes on over ~token among them: the lowest indices are kept, the same ones for any P.
// The caller has histogrammed the first digit into hist[0] (clear_hist(sh, 0), then the max pass) when k < V.
template <typename T, bool PEN>
__device__ Threshold radix_select(const Row<T, PEN>& row, int V, int k, int s_lo, int s_hi, int P, SelectShared& sh) {
    Threshold t{0u, 0u, 0};
    if (k >= V) return t;
    if (threadIdx.x == 0) {
        sh.remaining = k;
        sh.greater = 0;  // keys above the bins chosen so far
    }
    Prefix q{0u, 0u, 0u, 0u};
    for (int shift = 24; shift >= 0; shift -= 8) {
        select_pass<false>(row, V, s_lo, s_hi, P, q, shift, t.passes, t.passes > 0, sh);
        ++t.passes;
        q.ph |= sh.digit << shift;
        q.mh |= 255u << shift;
        // the chosen bin and every key above it fit the candidates: gather them all (keys >= the bin's least, the
        // threshold's lower bits 0), and the draw keeps the k largest and their ties once they are sorted. Without
        // this, 1-2 more passes of the row (each a cluster barrier) to pin the k-th key down.
        if (sh.fits) break;
    }
    t.hi = q.ph;
    const int greater = k - sh.remaining;  // keys above the chosen bin
    if (greater + sh.tie <= CAND_CAP) return t;
    __syncthreads();  // every thread has read remaining / tie / done
    if (threadIdx.x == 0) sh.remaining = CAND_CAP - greater;
    for (int shift = 24; shift >= 0; shift -= 8) {
        select_pass<true>(row, V, s_lo, s_hi, P, q, shift, t.passes, true, sh);
        ++t.passes;
        q.pl |= sh.digit << shift;
        q.ml |= 255u << shift;
        if (sh.done) break;
    }
    t.lo = q.pl;
    return t;
}

// Where the candidates go: block 0's slots and counters (in another block of the cluster, or this one).
struct CandSink {
    unsigned long long* cand;
    int* n_cand;
    int* n_nan;  // NaNs whose key is above +inf's: the select ranked them above every number, the draw skips them
};

// Token v of value x into the sink when it is a candidate: not NaN, and key > t.hi, or key == t.hi and ~token >= t.lo
// (bound: one 64-bit compare of the sort key). Predicated atomics: the compiler aggregates a warp's candidates into
// one, and a token that is none costs a compare, not a warp vote; slots come in any order, the sort orders them.
__device__ __forceinline__ void push_candidate(float x, int v, unsigned long long bound, CandSink out) {
    const uint32_t key = float_key(x);
    if (isnan(x)) {
        if (key > float_key(INFINITY)) atomicAdd(out.n_nan, 1);
        return;
    }
    const unsigned long long c = ((unsigned long long)key << 32) | (0xffffffffu - (uint32_t)v);
    if (c >= bound) {
        const int slot = atomicAdd(out.n_cand, 1);
        if (slot < CAND_CAP) out.cand[slot] = c;
    }
}

__device__ __forceinline__ unsigned long long candidate_bound(Threshold t) {
    return ((unsigned long long)t.hi << 32) | t.lo;
}

// Top-k rows (top_k > 0) draw from the candidates' own mass, not the row's: this block's segments' candidates alone
// (the sink may be block 0's), a token whose penalized logit is under the threshold's logit_bounds skipping the
// division.
template <typename T, bool PEN>
__device__ void gather_top_k(const Row<T, PEN>& row, int V, int s_lo, int s_hi, Threshold t, CandSink out) {
    const unsigned long long bound = candidate_bound(t);
    const LogitBounds lb = logit_bounds(t.hi, 0xffffffffu, row.inv_temp_div, row.scaled);
    for_each_segment(row, V, s_lo, s_hi, [&](int v, float l, bool ok) {
        if (!ok) return;
        l = row.penalized(v, l);
        if (l <= lb.lo) return;  // under the k-th value
        push_candidate(row.scale(l), v, bound, out);
    }, [](int) {});
}

// Top-p rows (CAND) and temperature-only rows: each segment's sum of exp(x - m) over this block's segments (8 tokens
// a thread in order, the warp's xor tree, the 32 warps in order: one order whichever block walks it) into
// seg_dst[s] (block 0's, maybe in another block of the cluster), and with CAND the candidates (push_candidate; the
// sink block 0's too).
template <bool CAND, typename T, bool PEN>
__device__ void gather(const Row<T, PEN>& row, int V, int s_lo, int s_hi, Threshold t, float m, SelectShared& sh,
                       CandSink out, float* seg_dst) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned long long bound = candidate_bound(t);
    for (int g = s_lo; g < s_hi; g += SEG_GROUP) {
        const int g_hi = min(s_hi, g + SEG_GROUP);
        float zc = 0.0f;
        for_each_segment(row, V, g, g_hi, [&](int v, float l, bool ok) {
            if (!ok) return;
            const float x = row.value_of(v, l);
            zc += expf(x - m);
            if (CAND) push_candidate(x, v, bound, out);
        }, [&](int s) {
            const float w = warp_sum(zc);
            if (lane == 0) sh.segw[(s - g) * 32 + warp] = w;
            zc = 0.0f;
        });
        __syncthreads();
        const int s = g + threadIdx.x;
        if (s < g_hi) {
            float sum = 0.0f;
            for (int w = 0; w < 32; ++w) sum += sh.segw[threadIdx.x * 32 + w];
            seg_dst[s] = sum;
        }
        __syncthreads();  // segw is read before the next group writes it
    }
}

// The sum of segments [0, segs) in order (block 0, once every segment's is in): the row's softmax mass.
__device__ __forceinline__ float segments_total(const float* seg, int segs) {
    float z = 0.0f;
    for (int i = 0; i < segs; ++i) z += seg[i];
    return z;
}

}  // namespace fllama
