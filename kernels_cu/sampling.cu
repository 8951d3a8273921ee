// Next-token sampling on the GPU, all state on the device so a decode step can be captured in a graph.
//
// One block of SAMPLE_THREADS per row i of logits [n, V] (fp16 or fp32), for state row b = rows[i] (rows null:
// b = i, n = B):
//   params  fp32 [B, 4]  temperature, top_k (an integer held in a float), top_p, repetition_penalty
//   seen    uint8 [B, V] tokens already in the row; the kernel marks the token it samples
//   finished int32 [B]   a finished row outputs eos_ids[0]; a row finishes when it samples any eos id
//   rng     int64 [B, 2] row b's Philox key (its seed) and draw counter, the counter incremented by the kernel
//   out     int32 [n]    the sampled token of logits row i
//   next_ids, lengths, active  int32 [B] or all null: a captured decode step's bookkeeping, done by thread 0
//           of each row (torch kernels there, with no programmatic launch, would cost the step ~4 us):
//           next_ids = out (the next step's input ids), lengths += active (rows that decoded advance); a row
//           with active 0 samples nothing and writes nothing (out keeps its old value)
//
// The order is model_zoo.sampling's: repetition penalty (HF: l > 0 ? l / p : l * p on seen tokens),
// greedy (argmax, lowest index on ties) when temperature == 0 or top_k == 1, else divide by temperature,
// keep the top_k largest (ties with the k-th kept), keep the smallest prefix of those in descending order
// whose mass before each kept token is < top_p, and draw from the softmax of what is left.
//   - top_k > 0 or top_p < 1: a radix select (sample_select.cuh; its first digit counted in the max pass) finds
//     the k-th largest value (k = top_k, or MAX_K when only top_p is set), the candidates (<= CAND_CAP with ties,
//     the lowest indices beyond) are sorted by a bitonic network held in registers (sample_sort.cuh), and the
//     block scans them for the nucleus and the draw. With top_p alone the nucleus is therefore limited to the MAX_K
//     largest logits (the mass is still normalised over the whole vocabulary, summed over fixed 8,192-token
//     segments so that a cluster's sum is the one block's).
//   - top_k == 0 and top_p == 1: an inverse-CDF draw over the whole vocabulary in index order, in two levels:
//     each 8,192-token segment's mass (gather), then block 0 picks the segment and, by a block scan of the
//     threads' 8-token chunks, the token in it.
// Random numbers: Philox-4x32-10 keyed by the row's seed, counter = its draw counter, so replays of one graph
// draw fresh numbers and a row's stream depends neither on the batch it runs in nor on its slot.
// *_cl entries (sm_90): grid (P, n), each row's P blocks one thread-block cluster. The max/argmax pass, which
// one block runs at ~12 instructions a token on one SM (14 us at 128k tokens), is split into P contiguous slices
// of whole 8-token chunks. Greedy rows: blocks 1..P-1 push their winner into block 0's shared memory and exit,
// and block 0 goes on as the one-block kernel does. Temperature-only rows: the segment sums run over the whole
// cluster too. Top-k / top-p rows: the radix select and the candidate gather as well (sample_select.cuh); block 0
// then sorts and draws alone.
#include "block_reduce.cuh"
#include "common.cuh"
#include "philox.cuh"
#include "sample_select.cuh"
#include "sample_sort.cuh"
#include "sample_values.cuh"

using namespace fllama;

constexpr int SAMPLE_THREADS = 1024;
constexpr int EOS_EARLY = 4;  // end-of-sequence ids read before the PDL wait (more are read after it)
static_assert(SAMPLE_THREADS == SEG_CHUNKS, "the select walks a segment as one 8-token chunk a thread");
static_assert(CAND_CAP <= 2 * SAMPLE_THREADS, "the sort holds two candidates a thread");

struct Shared {
    float fv[32];
    int fi[32];
    float incl[SAMPLE_THREADS];
    int pick, pick_seg;  // the drawn token; the whole-vocabulary draw's segment
    float rest;          // and the target's mass into it
    float part_v[CLUSTER_MAX], part_i[CLUSTER_MAX];  // _cl, block 0: the other blocks' winners (cluster_argmax)
    int eos[EOS_EARLY];  // thread 0's, from before the wait (shared memory: no registers held through the row)
    int new_length;
    uint32_t kth;      // the draw's k-th largest value key
    SelectShared sel;  // top-k / top-p
};

// The decode step's bookkeeping for row b (thread 0), once its token is known. new_length() runs before the PDL
// wait: lengths and active are written only by earlier steps' sampling and the host, never by the kernels this one
// may overlap, and reading them there keeps two L2 round trips off the step's last kernel.
struct StepOut {
    int* next_ids;
    int* lengths;
    const int* active;

    __device__ __forceinline__ int new_length(int b) const {
        return next_ids != nullptr ? lengths[b] + active[b] : 0;
    }
    __device__ __forceinline__ void write(int b, int token, int new_len) const {
        if (next_ids == nullptr) return;
        next_ids[b] = token;
        lengths[b] = new_len;
    }
};

// The temperature-only draw from block 0's segment sums: thread 0 draws the target and finds its segment in index
// order (the sums folded in segments_total's order, so the target lies in one); the block scans that segment's
// 8-token chunks (gather's exps) and the thread whose range holds the rest of the target finds the token. A NaN or
// infinite mass (a row of -inf or NaN logits) finds no segment and falls back to the argmax.
template <typename T, bool PEN>
__device__ int draw_whole(const Row<T, PEN>& row, int V, int segs, float m, unsigned long long seed,
                          unsigned long long counter, int argmax, Shared& sh) {
    const int tid = threadIdx.x;
    if (tid == 0) {
        const float z = segments_total(sh.sel.seg, segs);
        float target = uniform01(seed, counter) * z;
        if (target >= z) target = nextafterf(z, 0.0f);
        float run = 0.0f;
        sh.pick_seg = -1;
        for (int s = 0; s < segs; ++s) {
            const float next = run + sh.sel.seg[s];
            if (next > target && sh.sel.seg[s] > 0.0f) {
                sh.pick_seg = s;
                sh.rest = target - run;
                break;
            }
            run = next;
        }
        sh.pick = 0x7fffffff;
    }
    __syncthreads();
    const int s = sh.pick_seg;
    if (s < 0) return argmax;
    const int v0 = s * SEG_TOKENS + 8 * tid;
    ChunkLoads<T> ld;
    if (v0 < V) ld.load(row.logits, V, 0, v0 / 8);
    const auto e = [&](int j) { return v0 + j < V ? expf(row.value_of(v0 + j, ld.logit(0, j)) - m) : 0.0f; };
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) part += e(j);
    const float incl = block_inclusive_scan(part, sh.incl, sh.fv);  // e(j) again after it: 8 fewer live registers
    const float excl = tid > 0 ? sh.incl[tid - 1] : 0.0f, total = sh.incl[blockDim.x - 1];
    const float rest = sh.rest < total ? sh.rest : nextafterf(total, 0.0f);  // the scan's rounding, not the sums'
    if (excl <= rest && rest < incl) {
        float run = excl;
        int found = -1, last = -1;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float ej = e(j);
            run += ej;
            if (ej > 0.0f) last = v0 + j;
            if (found < 0 && run > rest && ej > 0.0f) found = v0 + j;
        }
        found = found >= 0 ? found : last;  // rounding put the target past this thread's last token
        if (found >= 0) atomicMin(&sh.pick, found);
    }
    __syncthreads();
    return sh.pick != 0x7fffffff ? sh.pick : argmax;
}

// The top-k / top-p draw from block 0's n candidates: sorted (sample_sort.cuh), cut to the k largest keys (NaNs above
// every number counted among them, as the select counts them) and their ties (the select may gather more), each
// thread's two slots weighed exp(x - m) and scanned over the block in sorted order. The nucleus keeps slot i while the
// mass before it is below top_p times the mass: the row's (z_full) with top-p alone, the candidates' with top-k. The
// target, drawn in the kept mass, picks the first slot whose running mass passes it (the last kept one if rounding
// leaves none). Not inlined: at the 64-register cap of 1024 threads, inlined it made the one-block entries spill.
__device__ __noinline__ int draw_candidates(int n, int k, int top_k, float top_p, float z_full, float m,
                                            unsigned long long seed, unsigned long long counter, int argmax,
                                            Shared& sh) {
    const int r = k - sh.sel.n_nan;  // the k-th key's slot + 1: NaNs the select ranked above every number are none
    if (n == 0 || r <= 0) return argmax;  // block-uniform
    const int tid = threadIdx.x, e = 2 * tid;
    unsigned long long c0, c1;
    sort_candidates(sh.sel.cand, n, &c0, &c1);
    if (r < n) {  // the slots whose value is at least the k-th's: a prefix
        if (e == r - 1) sh.kth = (uint32_t)(c0 >> 32);
        if (e + 1 == r - 1) sh.kth = (uint32_t)(c1 >> 32);
        __syncthreads();
        const uint32_t kth = sh.kth;
        n = __syncthreads_count(e < n && (uint32_t)(c0 >> 32) >= kth) +
            __syncthreads_count(e + 1 < n && (uint32_t)(c1 >> 32) >= kth);
    }
    const auto weight = [&](unsigned long long c, int i) {
        return i < n ? expf(key_float((uint32_t)(c >> 32)) - m) : 0.0f;
    };
    const float w0 = weight(c0, e), w1 = weight(c1, e + 1);
    const float incl1 = block_inclusive_scan(w0 + w1, sh.incl, sh.fv);  // its barriers publish the sort's cand too
    const float excl0 = tid > 0 ? sh.incl[tid - 1] : 0.0f, incl0 = excl0 + w0;
    int kept = n;
    if (top_p < 1.0f) {  // slots kept form a prefix: the running mass never falls
        const float limit = top_p * (top_k > 0 ? sh.incl[blockDim.x - 1] : z_full);
        kept = max(__syncthreads_count(e < n && excl0 < limit) + __syncthreads_count(e + 1 < n && incl0 < limit), 1);
    }
    if (tid == 0) sh.pick = 0x7fffffff;
    if (e == kept - 1) sh.rest = incl0;  // the kept mass
    if (e + 1 == kept - 1) sh.rest = incl1;
    __syncthreads();
    const float s = sh.rest;
    float target = uniform01(seed, counter) * s;
    if (target >= s) target = nextafterf(s, 0.0f);
    if (e < kept && incl0 > target) atomicMin(&sh.pick, e);
    else if (e + 1 < kept && incl1 > target) atomicMin(&sh.pick, e + 1);
    __syncthreads();
    const int i = sh.pick != 0x7fffffff ? sh.pick : kept - 1;
    return (int)(0xffffffffu - (uint32_t)(sh.sel.cand[i] & 0xffffffffull));
}

// CL: the _cl entries (grid (P, n), a cluster of P blocks a row), else one block a row (grid (n)).
template <typename T, bool CL>
__device__ void sample_row(int* __restrict__ out, uint8_t* __restrict__ seen, int* __restrict__ finished,
                           long long* __restrict__ rng, const T* __restrict__ logits,
                           const float* __restrict__ params, const int* __restrict__ eos_ids, int n_eos, int V,
                           StepOut step, const int* __restrict__ rows) {
    __shared__ Shared sh;
    const int i_out = CL ? blockIdx.y : blockIdx.x, tid = threadIdx.x;
    const int rank = CL ? blockIdx.x : 0, P = CL ? gridDim.x : 1;  // rank: the block's place in its row's cluster
    if (CL) cluster_arrive_relaxed();  // phase 1 (cluster_argmax / the select): this block has started
    const int b = rows != nullptr ? rows[i_out] : i_out;  // the state row; logits and out are indexed by i_out
    // Before the PDL wait, the row's state: only earlier launches of this kernel (their steps long complete) and
    // the host write finished, params, rng, eos_ids and the step's lengths / active, so only the logits, which
    // the kernel before this one writes, wait. In a decode step that is four L2 round trips fewer after the
    // lm_head GEMV. Every block of a cluster reads the same row state, so all of them leave together or none.
    const int is_finished = finished[b];
    // a decode graph covers rows that are not decoding (free slots, rows still prefilling): they draw nothing, so
    // their seen mask and draw counter stay as the host set them
    const bool idle = step.active != nullptr && step.active[b] == 0;
    const float temperature = params[4 * b], top_p = params[4 * b + 2], penalty = params[4 * b + 3];
    const int top_k = min(max(__float2int_rn(params[4 * b + 1]), 0), MAX_K);
    unsigned long long seed = 0, counter = 0;
    if (rank == 0) {  // what only block 0 reads: the draw and the bookkeeping are its alone
        seed = (unsigned long long)rng[2 * b];
        counter = (unsigned long long)rng[2 * b + 1];
        if (tid == 0) {  // thread 0 alone writes and reads these
#pragma unroll
            for (int i = 0; i < EOS_EARLY; ++i) sh.eos[i] = i < n_eos ? eos_ids[i] : eos_ids[0];
            sh.new_length = step.new_length(b);
        }
    }
    pdl_enter();
    if (idle) return;
    if (is_finished) {
        if (rank == 0 && tid == 0) {
            out[i_out] = sh.eos[0];
            step.write(b, sh.eos[0], sh.new_length);
        }
        return;
    }
    // the token, or -1 in a block of a cluster that leaves the rest to block 0
    const auto pick = [&](auto row) -> int {
        int token;
        // max (and argmax, the greedy answer and the fallback of the draws), over this block's slice of the row's
        // 8-token chunks (16-byte aligned wherever V % 8 == 0): the whole row without a cluster
        row.scaled = !(temperature <= 0.0f || top_k == 1);
        // top-k / top-p rows keep the whole cluster for the select, temperature-only ones for the segment sums;
        // greedy rows leave it to block 0 after this pass
        const bool whole = row.scaled && top_k == 0 && top_p >= 1.0f;
        const bool select = row.scaled && !whole;
        const int k = min(top_k > 0 ? top_k : MAX_K, V);
        const int chunks = (V + 7) / 8, per_block = (chunks + P - 1) / P;
        const int c_lo = min(chunks, rank * per_block), c_hi = min(chunks, c_lo + per_block);
        ArgMax best{-INFINITY, 0x7fffffff};
        const auto argmax_of = [&](int v, float x) {
            if (x > best.v || (best.i == 0x7fffffff && !isnan(x))) best = ArgMax{x, v};
        };
        if (select && k < V) {  // the select's first digit over every token here: radix_select walks the row once less
            clear_hist(sh.sel, 0);
            __syncthreads();
            for_each_value(row, V, c_lo, c_hi, [&](int v, float x) {
                argmax_of(v, x);
                atomicAdd(&sh.sel.hist[0][float_key(x) >> 24], 1);
            });
        } else {
            for_each_value(row, V, c_lo, c_hi, argmax_of);
        }
        best = block_argmax(best, sh.fv, sh.fi);  // (its barriers complete hist[0] too)
        // greedy rows: blocks 1..P-1 are done here
        if (CL && !row.scaled && !cluster_argmax(best, rank, P, sh.part_v, sh.part_i)) return -1;
        int argmax = best.i < V ? best.i : 0;
        float m = best.v;
        const int segs = (V + SEG_TOKENS - 1) / SEG_TOKENS, per = (segs + P - 1) / P;
        const int s_lo = min(segs, rank * per), s_hi = min(segs, s_lo + per);  // this block's segments
        // the row's max from every block's winner (win_v / win_i, stored before a cluster barrier this block has
        // passed)
        const auto take_cluster_max = [&]() {
            best = cluster_argmax_all(&sh.sel.win_v, &sh.sel.win_i, P);
            argmax = best.i < V ? best.i : 0;
            m = best.v;
        };

        if (!row.scaled) {
            token = argmax;
        } else if (whole) {
            if (CL) {
                cluster_wait_acquire();  // phase 1: every block has started
                if (tid == 0) {
                    sh.sel.win_v = best.v;
                    sh.sel.win_i = best.i;
                }
                cluster_sync();  // every block's winner is in
                take_cluster_max();
            }
            gather<false>(row, V, s_lo, s_hi, Threshold{}, m, sh.sel, CandSink{},
                          CL ? cluster_ptr(sh.sel.seg, 0) : sh.sel.seg);
            if (CL) {
                cluster_sync();  // block 0 holds every segment's sum; nobody reads another block after it
                if (rank != 0) return -1;
            }
            token = draw_whole(row, V, segs, m, seed, counter, argmax, sh);
        } else {
            // ---- top-k / top-p: the candidates over this block's segments (sample_select.cuh), sorted, scanned
            if (CL) cluster_wait_acquire();  // phase 1: every block has started, so its shared memory may be written
            if (tid == 0) {  // read by the cluster (block 0's counter: written by all) after the next barrier
                sh.sel.win_v = best.v;
                sh.sel.win_i = best.i;
                sh.sel.n_cand = 0;
                sh.sel.n_nan = 0;
                sh.sel.z_full = 0.0f;  // top-k rows: no sum (the draw's mass is the candidates')
            }
            const Threshold t = radix_select(row, V, k, s_lo, s_hi, P, sh.sel);
            if (t.passes == 0) {
                if (CL) cluster_sync();
                else __syncthreads();
            }
            if (CL) take_cluster_max();  // the segment sums and block 0's draw need m
            const CandSink sink = CL ? CandSink{cluster_ptr(sh.sel.cand, 0), cluster_ptr(&sh.sel.n_cand, 0),
                                                cluster_ptr(&sh.sel.n_nan, 0)}
                                     : CandSink{sh.sel.cand, &sh.sel.n_cand, &sh.sel.n_nan};
            if (top_k > 0) gather_top_k(row, V, s_lo, s_hi, t, sink);
            else gather<true>(row, V, s_lo, s_hi, t, m, sh.sel, sink, CL ? cluster_ptr(sh.sel.seg, 0) : sh.sel.seg);
            if (CL) {
                cluster_sync();  // block 0 holds every candidate and segment sum; nobody reads another block after it
                if (rank != 0) return -1;
            }
            __syncthreads();  // the candidates and segment sums are in
            if (tid == 0 && top_k == 0) sh.sel.z_full = segments_total(sh.sel.seg, segs);
            __syncthreads();  // z_full is in
            token = draw_candidates(min(sh.sel.n_cand, CAND_CAP), k, top_k, top_p, sh.sel.z_full, m, seed, counter,
                                    argmax, sh);
        }
        return token;
    };
    const T* lg = logits + (size_t)i_out * V;
    const uint8_t* sn = seen + (size_t)b * V;
    const int token = penalty != 1.0f ? pick(Row<T, true>{lg, sn, penalty, temperature, false})
                                      : pick(Row<T, false>{lg, sn, penalty, temperature, false});
    if (token < 0) return;

    if (tid == 0) {
        out[i_out] = token;
        seen[(size_t)b * V + token] = 1;
        bool eos_hit = false;
#pragma unroll
        for (int i = 0; i < EOS_EARLY; ++i) eos_hit |= sh.eos[i] == token;  // (ids past n_eos repeat id 0)
        for (int i = EOS_EARLY; i < n_eos; ++i) eos_hit |= eos_ids[i] == token;
        if (eos_hit) finished[b] = 1;
        rng[2 * b + 1] = (long long)(counter + 1);
        step.write(b, token, sh.new_length);
    }
}

#define FLLAMA_SAMPLE(NAME, T, CL)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                   \
        NAME(int* out, uint8_t* seen, int* finished, long long* rng, const T* logits, const float* params,         \
             const int* eos_ids, int n_eos, int V, int* next_ids, int* lengths, const int* active, const int* rows) { \
        sample_row<T, CL>(out, seen, finished, rng, logits, params, eos_ids, n_eos, V,                              \
                          StepOut{next_ids, lengths, active}, rows);                                              \
    }

FLLAMA_SAMPLE(sample_f16, __half, false)
FLLAMA_SAMPLE(sample_f32, float, false)
FLLAMA_SAMPLE(sample_f16_cl, __half, true)
FLLAMA_SAMPLE(sample_f32_cl, float, true)
