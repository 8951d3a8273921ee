// Decode attention in one launch (the engine's; attention_decode.cu is the two-kernel form and its notation).
// attn_fused_d{64,128}[_kv8|_kvf8]: attention_decode.cu's tensor-core tiles, reorganised for bandwidth and with the
// combine (and optionally the per-token int8 quantization of the output) done by the last block to finish.
// Its pieces: attention_stage.cuh (geometry, copies, a warp's tile), attention_rope.cuh (RoPE mode),
// attention_combine.cuh (the merges and combines).
//   grid (S splits, B * Hkv * HG units), block 128 (4 warps). A unit is (row b, kv head, group of <= 8
//   query heads). Its row's tiles of 16 positions are split evenly over the first n <= S blocks at run
//   time, from lengths[b] read on the device (tps = ceil(tiles / S) tiles per block, or span_tiles when
//   the launcher fixes the chunk), so one launch shape serves every step and no block idles while
//   another streams the whole context.
//   1. cp.async streams the block's K and V (and 8-bit scales) into shared memory in stages of 64
//      positions, double buffered: every thread has a whole stage of 16-byte copies in flight while the
//      warps work on the previous one. Copies past the block's end are zero-filled (the cache may hold
//      NaN there).
//   2. warp w takes tile w of each stage: S = K Q^T with A from ldmatrix (fp16) or converted 8-bit rows,
//      online softmax per head (running max m, lane-partial sum l, accumulators rescaled by 2^(m_old -
//      m_new)), P rounded to fp16 through a warp-private transpose buffer, O^T += V^T P^T with A from
//      ldmatrix.trans (fp16) or the prmt transpose of converted 8-bit rows (int8 and e4m3 differ only in the
//      conversion, kv_codes.cuh).
//   3. the 4 warps' (m, l, O) merge in shared memory. A unit with one active block writes out = O / l.
//      Otherwise the block writes (O, m, l) to the workspace, fences, and bumps the unit's counter; the
//      block that brings it to n resets it to 0 (so a CUDA graph needs no memset node) and combines the
//      n partials in split order (deterministic, whichever block is last).
//   4. int8 output: static amax -> each unit's finishing block quantizes its own heads; dynamic ->
//      after writing its heads' fp16 output the finishing block bumps the row's counter, and the row's
//      last block reads the row's H * D fp16 values back (L2), takes amax and quantizes, so q_out equals
//      quantize_ref(out) bit for bit. Or (amax_part) no quantization here: the finishing block writes its
//      unit's max |out|, and the o_proj GEMV quantizes (int8_gemm.cu, XqHook).
//   counters int32 [units + B], zero before the first launch, zero again after every launch.
// *_cl entries (CL): the same kernel launched in thread-block clusters of S blocks (cluster dims (S, 1, 1), S
//   <= 16), one cluster per unit, for the small-batch grids where a unit has several blocks (LLaMA-2-7B at
//   batch 1: S = 10, the most whose 32 clusters are all resident at once; attention_decode.py picks S).
//   Step 3 then needs no global round trips: each block leaves its (O, m, l) in its own
//   shared memory, the cluster meets at a barrier (release / acquire), block 0 reads the partials through
//   distributed shared memory (ld.shared::cluster: every thread issues all its loads at once, one round trip)
//   and combines them in split order (the same arithmetic as the workspace path, so the same bits), and a
//   second barrier keeps every block's shared memory alive until block 0 has read it. No fence, no counter,
//   no workspace. Push mode, where block 0's range is one stage (short contexts, the common decode case) and the
//   partials fit in the shared memory it leaves unused (Geom::PUSH_OFF): each other block stores its partial
//   into block 0's shared memory by st.async, each store completing its bytes on block 0's mbarrier, and exits at
//   once; block 0 waits on that barrier for all the bytes and combines from its own shared memory, with no remote
//   round trip, no second cluster barrier and no fence (a release arrival on the cluster barrier is a GPU-scope
//   MEMBAR that waits for every store in flight: ~0.6 us a layer). Blocks past
//   the row's end exit at once: a cluster barrier waits only for threads that have not exited (PTX ISA), and
//   nothing reads their shared memory.
// RoPE mode (qkv non-null; q unused): the kernel takes the fused QKV GEMV output and does rope_kv.cu's work
//   for the new token of each row, bit for bit, so the decode step needs no rope_kv launch. Row b's new
//   token sits at p = lengths[b] - 1 (cache row b). Stage 0's copies go out before the PDL wait (they read
//   rows that earlier steps wrote, never p's: see below), so in steps whose kernels trigger early (common.cuh,
//   trigger 4) they stream under the q|k|v GEMV's tail. Every block rotates the query heads it needs itself,
//   once its stage-0 copies are issued (the loads' latency then overlaps the stream). The unit's last
//   active block (its range ends at the row's length, so its last stage holds p) rotates k, quantizes k
//   and v for an 8-bit cache, and stores them at p. When p's stage is stage 0 (the only one: short contexts,
//   the common decode case) p gets no copy and the same bytes go straight into the stage's row, so this
//   block, which every cluster waits for, issues its copies without first waiting for the store (else it
//   trails the others); with more stages the store happens while stage 0 streams and the loop's barriers
//   order it before the last stage's copies. Head groups of one kv head (HG > 1) each store the same
//   bytes, so no block reads another block's store. rope_kv's guards with pos = p: p outside the cos/sin
//   table -> q = 0 and no store; p >= L or an empty row -> no store.
#include "attention_combine.cuh"
#include "attention_rope.cuh"
#include "attention_stage.cuh"

using namespace fllama;

namespace fllama::fused {

template <int D, int KV, bool CL>
__device__ __forceinline__ void attn_fused(__half* __restrict__ out, int8_t* __restrict__ q_out,
                                           float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                           float* __restrict__ amax_part,
                                           float* __restrict__ part_o, float* __restrict__ part_ml,
                                           int* __restrict__ counters, const __half* __restrict__ q,
                                           const __half* __restrict__ qkv, const float* __restrict__ cos_sin,
                                           void* __restrict__ k_cache, void* __restrict__ v_cache,
                                           float* __restrict__ k_scale, float* __restrict__ v_scale,
                                           const int* __restrict__ lengths, int H, int Hkv, int L, int S,
                                           int span_tiles, int max_pos, float scale_log2) {
    constexpr bool KV8 = KV != KV_F16;  // 8-bit codes with scales: one layout for int8 and e4m3
    using G = Geom<D, KV8>;
    constexpr int MT = D / 16;  // 16-dim tiles of the output, 16-dim k steps of the scores
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_last;
    __shared__ float s_red[32];
    __shared__ float s_l[SLOTS];
    __shared__ __align__(8) uint64_t s_push;  // CL push mode: block 0's mbarrier, completed by the pushed bytes
    __shared__ float2 s_pml[CLUSTER_MAX - 1][SLOTS];  // CL push mode: (m, l) of splits 1.. in block 0

    if (dynamic_smem_size() < (uint32_t)G::SMEM) __trap();  // the launcher disagrees with this layout
    const int R = H / Hkv, HG = (R + SLOTS - 1) / SLOTS;
    const int units = gridDim.y, u = blockIdx.y, split = blockIdx.x;
    const int rows = units / (HG * Hkv);  // the batch's rows, for the PDL trigger
    // The PDL wait: at once, except in RoPE mode (qkv), which issues its first stage's copies before it (below).
    // lengths and the cache may be read before it: the kernels that wrote them had completed when the kernel
    // before this one (the q|k|v GEMV) passed its own wait, and it lets this one start only after that.
    if (qkv == nullptr) pdl_enter_attention(rows);
    const int hg = u % HG, kvh = (u / HG) % Hkv, b = u / (HG * Hkv);
    const int len_b = lengths[b];
    const int len = min(max(len_b, 0), L);
    const int ntiles = (len + 15) / 16;
    const int tps = span_tiles > 0 ? span_tiles : max(1, (ntiles + S - 1) / S);
    const int n_act = len > 0 ? (ntiles + tps - 1) / tps : 1;  // an empty row: block 0 writes zeros
    attn_stamp(1);
    // CL: nothing reads an idle block's shared memory, and the cluster's barriers wait only for threads that have
    // not exited, so it leaves at once (its exit also counts as its PDL trigger)
    if (split >= n_act) return;  // whole block, before any barrier

    const int slots = min(SLOTS, R - hg * SLOTS), head0 = kvh * R + hg * SLOTS;
    // CL push mode, where block 0's range is one stage and the partials fit beside it: each other block stores its
    // partial straight into block 0's shared memory (Geom::PUSH_OFF and s_pml) by st.async and exits; block 0 waits
    // on its mbarrier s_push for the bytes and combines from its own shared memory (push_combine). That saves the
    // pull's DSMEM round trip and the second barrier, which keeps every block until block 0 has read it. The cluster
    // barrier's one phase, arrived at here, says that every block has started and that block 0's mbarrier is
    // initialized: shared memory may be written remotely only then.
    const bool push = CL && n_act > 1 && min(tps * 16, len) <= STAGE &&
                      (n_act - 1) * slots * D * 4 <= G::PUSH_BYTES;  // the same in every block of the unit
    if (push) {
        if (split == 0) {
            if (threadIdx.x == 0) {  // before the phase-1 arrival; its one arrival announces every byte
                mbar_init_cluster(smem_addr(&s_push), 1);
                mbar_expect_tx(smem_addr(&s_push), (n_act - 1) * slots * (D + 2) * 4);
            }
            for (int i = threadIdx.x; i < (CLUSTER_MAX - 1) * SLOTS; i += THREADS)  // the splits past the unit's
                if (i / SLOTS >= n_act - 1) s_pml[i / SLOTS][i % SLOTS] = make_float2(-INFINITY, 0.0f);
        }
        cluster_arrive_relaxed();
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const size_t row0 = ((size_t)b * Hkv + kvh) * L;
    float* wo = reinterpret_cast<float*>(smem);  // merge area [WARPS][SLOTS][D], then m, l [WARPS][SLOTS]
    float* wm = wo + WARPS * SLOTS * D;
    float* wl = wm + WARPS * SLOTS;

    if (len > 0) {
        const int lo = split * tps * 16, hi = min(lo + tps * 16, len);
        const int nstages = (hi - lo + STAGE - 1) / STAGE;
        // RoPE mode: the new token's position (>= 0 as len > 0) and its cos/sin row (max_pos is 0 otherwise)
        const int p_new = len_b - 1;
        const bool rot_ok = p_new < max_pos;
        const float* cs_row = cos_sin + (size_t)(rot_ok ? p_new : 0) * D;
        __half* ph = reinterpret_cast<__half*>(smem + NBUF * G::BUF_BYTES) + warp * SLOTS * PH_STRIDE;

        const bool new_kv = qkv != nullptr && split == n_act - 1 && rot_ok && p_new < L;  // block-uniform
        // p's stage: the only one when nstages == 1, else the last. With one stage the block writes p's row into
        // it directly (after issuing the copies of the others): the last block, on every cluster's critical
        // path, then waits for no L2 round trip before its copies. With more, p's row is stored during stage 0
        // and the copies of the last stage, issued after a loop barrier, read it back.
        const int skip = new_kv && nstages == 1 ? p_new : -1;
#pragma unroll
        for (int s = 0; s < NBUF - 1; ++s) {
            if (s < nstages)
                issue_stage<D, KV8>(smem + s * G::BUF_BYTES, k_cache, v_cache, k_scale, v_scale, row0,
                                    lo + s * STAGE, hi, skip);
            cp_async_commit();
        }
        // RoPE mode: these copies read only cache rows that earlier steps wrote (the new token's row is skipped, or
        // in a later stage, copied after its store), so they go out before the PDL wait and stream while the q|k|v
        // GEMV finishes; the query, the new k and v and everything this kernel writes come after the wait.
        if (qkv != nullptr) pdl_enter_attention(rows);
        attn_stamp(12);
        // the query heads as the B operand, in the k order the K fragments come in (raw in RoPE mode, rotated
        // once the stage-0 copies are issued)
        uint32_t qb[MT][2], qp[MT][2];
        uint4 cs4;
        {
            const bool qok = g < slots;
            const int qh = head0 + (qok ? g : 0);
            const __half* qrow = qkv != nullptr ? qkv + ((size_t)b * (H + 2 * Hkv) + qh) * D
                                                : q + ((size_t)b * H + qh) * D;
#pragma unroll
            for (int st = 0; st < MT; ++st) {
                if (KV8) {  // lane t's dims [t D/4, (t + 1) D/4) as pairs, word 2 st and 2 st + 1
                    const uint2 w = ld_cached8(qrow + t * (D / 4) + 4 * st, qok);
                    qb[st][0] = w.x;
                    qb[st][1] = w.y;
                } else {  // natural: dims 16 st + 2t (+1) and 16 st + 8 + 2t (+1)
                    qb[st][0] = qok ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * st + 2 * t)) : 0u;
                    qb[st][1] = qok ? __ldg(reinterpret_cast<const uint32_t*>(qrow + 16 * st + 8 + 2 * t)) : 0u;
                }
            }
            if (qkv != nullptr) rope_query_load<D, KV8>(qp, cs4, qrow, qok, cs_row, lane);
        }
        Half8 kv_lo, kv_hi;  // warp 0 of the new token's block: its k and v chunks, loaded with the query
        if (new_kv && warp == 0) {
            const __half* k_src = qkv + ((size_t)b * (H + 2 * Hkv) + H + kvh) * D;  // v: Hkv * D further
            load_new_kv<D>(k_src, k_src + (size_t)Hkv * D, kv_lo, kv_hi);
        }
        auto store_kv = [&] {  // warp 0
            store_new_kv<D, KV>(kv_lo, kv_hi, cs_row, k_cache, v_cache, k_scale, v_scale, row0 + p_new,
                                 skip >= 0 ? smem : nullptr, p_new - lo);
        };

        float o[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) o[mt][r] = 0.0f;
        float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // heads 2t, 2t + 1

        if (qkv != nullptr) rope_query<D, KV8>(qb, qp, cs4, rot_ok, ph, lane);
        attn_stamp(13);
        if (new_kv && warp == 0) store_kv();  // before the loop's first barrier, which orders p's stage row
        attn_stamp(2);
        if (push) cluster_wait_acquire();  // block 0 has started and set up s_push (long since): under the copies
        attn_stamp(10);
        for (int s = 0; s < nstages; ++s) {
            cp_async_wait<NBUF - 2>();
            __syncthreads();  // stage s landed for every thread; every warp is done with stage s - 1
            if (s == 0) attn_stamp(3);
            {
                const int sn = s + NBUF - 1;
                if (sn < nstages)
                    issue_stage<D, KV8>(smem + (sn % NBUF) * G::BUF_BYTES, k_cache, v_cache, k_scale, v_scale,
                                        row0, lo + sn * STAGE, hi);
                cp_async_commit();  // possibly empty: keeps the group count uniform
            }
            const int t0 = lo + s * STAGE + 16 * warp;  // this warp's tile
            if (t0 >= hi) continue;                    // warp-uniform
            const unsigned char* kt = smem + (s % NBUF) * G::BUF_BYTES + 16 * warp * G::ROW;
            const float* ksc = reinterpret_cast<const float*>(smem + (s % NBUF) * G::BUF_BYTES + 2 * G::KV_BYTES) +
                               16 * warp;
            tile_step<D, KV>(kt, ksc, qb, t0, hi, scale_log2, ph, o, m0, m1, l0, l1);
        }
        cp_async_wait<0>();
        __syncthreads();  // the stage buffers become the merge area
        attn_stamp(4);

#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            l0 += __shfl_xor_sync(FULL_MASK, l0, off);
            l1 += __shfl_xor_sync(FULL_MASK, l1, off);
        }
        // only the unit's head slots: with one query head per kv head (no GQA) that is 1 lane in 4 and half
        // its values, so the stores of lanes t = 0..3 (same bank, D floats apart) do not conflict
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int slot = 2 * t + (r & 1);
                if (slot < slots) wo[(warp * SLOTS + slot) * D + acc_dim<D, KV8>(mt, r, g)] = o[mt][r];
            }
        if (g == 0) {
            wm[warp * SLOTS + 2 * t] = m0;
            wm[warp * SLOTS + 2 * t + 1] = m1;
            wl[warp * SLOTS + 2 * t] = l0;
            wl[warp * SLOTS + 2 * t + 1] = l1;
        }
        __syncthreads();
        attn_stamp(9);
    } else if (qkv != nullptr) {
        pdl_enter_attention(rows);  // an empty row streams nothing, but the writes below wait
    }

    // the block's result per (head slot, dim): final when the unit has one block, else a partial
    const size_t out_row = (size_t)b * H * D;  // out / q_out offset of row b
    const bool quant_static = q_out != nullptr && static_amax != nullptr;
    const float inv_static = quant_static ? __fdiv_rn(127.0f, clamp_amax(*static_amax)) : 0.0f;
    float out_amax = 0.0f;  // max |out| of the values this thread wrote (amax_part)
    auto emit = [&](int h, int d, __half y) {  // a final output value: fp16, its max, its static quantization
        const size_t o = out_row + (size_t)(head0 + h) * D + d;
        out[o] = y;
        out_amax = fmaxf(out_amax, fabsf(__half2float(y)));
        if (quant_static) q_out[o] = quantize_i8(__half2float(y), inv_static);
    };
    if (push) {  // block 0 combines in its own shared memory; the others push their partials there and exit
        const bool block0 = push_combine<D>(wo, wm, wl, reinterpret_cast<float*>(smem + G::PUSH_OFF), s_pml,
                                            smem_addr(&s_push), slots, split, n_act, emit);
        attn_stamp(block0 ? 11 : 5);
        attn_stamp(7);
        if (!block0) return;
    } else if (!pull_combine<D, KV8, CL>(smem, wo, wm, wl, part_o, part_ml, counters, s_last, s_l,
                                         UnitSplit{b, H, head0, S, split, n_act, slots, u}, len, emit)) {
        return;
    }

    // this block finished its unit's heads
    if (amax_part != nullptr) {  // the unit's max |out|, for an int8 o_proj that quantizes its input itself
        const float m = block_max(out_amax, s_red);
        if (tid == 0) amax_part[u] = m;  // [B, Hkv * HG] flattened: unit u of row b is b * Hkv * HG + ...
        return;
    }
    if (q_out == nullptr) return;
    if (quant_static) {
        if (tid == 0 && kvh == 0 && hg == 0) a_scale[b] = __fdiv_rn(clamp_amax(*static_amax), 127.0f);
        return;
    }
    if (last_block_arrives(&counters[units + b], Hkv * HG, s_last))
        quantize_row(out + out_row, q_out + out_row, a_scale + b, H * D, s_red);
}

}  // namespace fllama::fused

// (out fp16 [B,H,D], q_out int8 [B,H*D] or null, a_scale f32 [B] or null, static_amax f32 [1] or null,
//  amax_part f32 [B, Hkv * HG] or null (q_out null: each unit's max |out|),
//  part_o f32 [B,H,S,D], part_ml f32 [B,H,S,2], counters i32 [units + B] (zero), q fp16 [B,H,D] or null,
//  qkv fp16 [B,(H+2Hkv)*D] or null (RoPE mode), cos_sin f32 [max_pos,D] or null,
//  k_cache, v_cache [B,Hkv,L,D] fp16 / int8 / e4m3, k_scale, v_scale f32 [B,Hkv,L] or null, lengths i32 [B],
//  int H, int Hkv, int L, int S, int span_tiles (0: split the length evenly over S), int max_pos,
//  float scale_log2)
// grid (S, B * Hkv * ceil(H / Hkv / 8)), block 128, dynamic shared memory Geom<D, KV8>::SMEM.
// MINB: resident blocks per SM the launcher counts on (d128 fp16: shared memory allows 3; others 4).
#define FLLAMA_ATTN_FUSED(NAME, D, KV, MINB) FLLAMA_ATTN_FUSED_CL(NAME, D, KV, MINB, false) \
    FLLAMA_ATTN_FUSED_CL(NAME##_cl, D, KV, MINB, true)
#define FLLAMA_ATTN_FUSED_CL(NAME, D, KV, MINB, CL)                                                         \
    extern "C" __global__ void __launch_bounds__(fused::THREADS, MINB)                                      \
        NAME(__half* out, int8_t* q_out, float* a_scale, const float* static_amax, float* amax_part,       \
             float* part_o,                                                                                 \
             float* part_ml, int* counters, const __half* q, const __half* qkv, const float* cos_sin,       \
             void* k_cache, void* v_cache, float* k_scale, float* v_scale, const int* lengths, int H, int Hkv, \
             int L, int S, int span_tiles, int max_pos, float scale_log2) {                                \
        attn_stamp(0);                                                                                     \
        fused::attn_fused<D, KV, CL>(out, q_out, a_scale, static_amax, amax_part, part_o, part_ml, counters, q, \
                                  qkv,                                                                     \
                                  cos_sin, k_cache, v_cache, k_scale, v_scale, lengths, H, Hkv, L, S,      \
                                  span_tiles, max_pos, scale_log2);                                        \
    }

FLLAMA_ATTN_FUSED(attn_fused_d64, 64, KV_F16, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128, 128, KV_F16, 3)
FLLAMA_ATTN_FUSED(attn_fused_d64_kv8, 64, KV_I8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128_kv8, 128, KV_I8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d64_kvf8, 64, KV_F8, 4)
FLLAMA_ATTN_FUSED(attn_fused_d128_kvf8, 128, KV_F8, 4)
