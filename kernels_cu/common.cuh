// Shared device helpers for fllama kernels: 16-byte fp16 vectors, warp/block reductions, int8 rounding.
// Arithmetic that must match the torch reference bit for bit uses the _rn intrinsics, which forbid
// nvcc from contracting a multiply and an add into one FMA.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace fllama {

constexpr unsigned FULL_MASK = 0xffffffffu;

// Eight fp16 values moved as one 16-byte load/store (pointers must be 16-byte aligned).
struct alignas(16) Half8 {
    __half2 h[4];
};

__device__ __forceinline__ Half8 load_half8(const __half* p) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    return *reinterpret_cast<Half8*>(&raw);
}

__device__ __forceinline__ void store_half8(__half* p, const Half8& v) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

__device__ __forceinline__ float half8_get(const Half8& v, int i) {
    return (i & 1) ? __high2float(v.h[i >> 1]) : __low2float(v.h[i >> 1]);
}

__device__ __forceinline__ __half half8_geth(const Half8& v, int i) {
    return (i & 1) ? __high2half(v.h[i >> 1]) : __low2half(v.h[i >> 1]);
}

__device__ __forceinline__ void half8_set(Half8& v, int i, __half x) {
    if (i & 1) {
        v.h[i >> 1] = __halves2half2(__low2half(v.h[i >> 1]), x);
    } else {
        v.h[i >> 1] = __halves2half2(x, __high2half(v.h[i >> 1]));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Block-wide sum / max; every thread of the block must call it; all get the result.
// `scratch` holds 32 floats of shared memory; blockDim.x a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;  // 0 is a safe identity: block_max is used on |x|
    return warp_max(v);
}

// threadFenceReduction (the CUDA samples' name): every thread of a block calls it after writing the block's
// partial results. Publishes them, counts the block in *counter and returns true in every thread of the last
// of n blocks to arrive, which puts the counter back to zero for the next launch (one pool of counters then
// serves every launch and CUDA graph). `flag` is a __shared__ int of the caller's; blockDim is 1-D.
__device__ __forceinline__ bool last_block_arrives(int* counter, int n, int& flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(counter, 1);
        flag = prev == n - 1;
        if (flag) atomicExch(counter, 0);
    }
    __syncthreads();
    if (!flag) return false;
    __threadfence();  // the other blocks' partial results are read after this
    return true;
}

// Symmetric int8: q = rint(v * inv) clamped to [-127, 127]; inv = 127 / amax computed once per row. Clamped first,
// then one round-to-nearest-even conversion: the same integer (inside the range nothing changes, beyond it both
// orders give the bound, NaN gives -127 both ways) with one instruction fewer than a round and a conversion.
__device__ __forceinline__ int quantize_int(float v, float inv) {
    return __float2int_rn(fminf(fmaxf(__fmul_rn(v, inv), -127.0f), 127.0f));
}
__device__ __forceinline__ int8_t quantize_i8(float v, float inv) { return static_cast<int8_t>(quantize_int(v, inv)); }

constexpr float MIN_AMAX = 1e-8f;

__device__ __forceinline__ float clamp_amax(float amax) { return fmaxf(amax, MIN_AMAX); }

// Eight fp16-valued floats quantized and packed into one 8-byte word (byte i = value i).
__device__ __forceinline__ uint2 quantize_pack8(const Half8& v, float inv) {
    int q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = quantize_int(half8_get(v, i), inv);
    return make_uint2(__byte_perm(__byte_perm(q[0], q[1], 0x0040), __byte_perm(q[2], q[3], 0x0040), 0x5410),
                      __byte_perm(__byte_perm(q[4], q[5], 0x0040), __byte_perm(q[6], q[7], 0x0040), 0x5410));
}

// ... and stored (pointer 8-byte aligned; global or shared memory).
__device__ __forceinline__ void quantize_store8(int8_t* p, const Half8& v, float inv) {
    *reinterpret_cast<uint2*>(p) = quantize_pack8(v, inv);
}

// quantize.cu's rule for a row of max |x| amax: inv = 127 / amax quantizes it, scale = amax / 127 is its a_scale
// (amax clamped first). Every dynamic or static int8 quantization calls this one expression: quantize.cu, rmsnorm.cu,
// silu_mul.cu, rope.cuh's KV rows, attention_fused.cu's output, and the deferred ones (fold_scales, int8_gemm.cu's
// hooks).
__device__ __forceinline__ void amax_scales(float amax, float& inv, float& scale) {
    amax = clamp_amax(amax);
    inv = __fdiv_rn(127.0f, amax);
    scale = __fdiv_rn(amax, 127.0f);
}

// The scales of a deferred int8 RMSNorm's row (norm_fold.py), from the max of its partial maxima of |xg| (amax) and
// the sum of its partial sums of h^2 (sum; has_norm false: no norm, rstd = 1) or a static amax: inv = 127 / amax
// (times rstd when static) quantizes xg, scale = amax / 127 (times rstd when dynamic) is a_scale. One expression
// for quantize.cu's quantize_fold and int8_gemm.cu's NormRowHook, so both give the same bits.
__device__ __forceinline__ void fold_scales(float amax, float sum, bool has_norm, const float* static_amax, int K,
                                            float eps, float& inv, float& scale) {
    amax_scales(static_amax == nullptr ? amax : *static_amax, inv, scale);
    if (has_norm) {
        const float rstd = rsqrtf(__fdividef(sum, (float)K) + eps);  // as norm_fold.cuh's fold_rstd
        const bool dynamic = static_amax == nullptr;
        scale = dynamic ? scale * rstd : scale;
        inv = dynamic ? inv : inv * rstd;
    }
}

__device__ __forceinline__ float half8_absmax(const Half8& v) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(half8_get(v, i)));
    return m;
}

// The dynamic shared memory this launch was given: kernels with a fixed layout trap when the launcher
// passed less (a mismatch between a .cu layout and its .py launcher, never a user error).
__device__ __forceinline__ uint32_t dynamic_smem_size() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// How a row kernel ends: fp16 out, int8 with a per-row dynamic scale, or int8 with a static amax.
// SiLU as torch computes F.silu on fp16: in fp32 (g / (1 + exp(-g))), rounded once to fp16.
__device__ __forceinline__ __half silu_h(float g) {
    return __float2half_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}

enum QuantMode { QUANT_NONE = 0, QUANT_DYNAMIC = 1, QUANT_STATIC = 2 };

// Programmatic dependent launch (sm_90; build.programmatic() launches with the attribute). A kernel so
// launched may start while the kernel before it in the stream is still running: it must not read that
// kernel's outputs, nor write anything it reads, before pdl_wait(), which returns once the previous grid
// has completed and its writes are visible. pdl_launch_dependents() then lets the next kernel start its
// own blocks as ours retire: called after the wait, so that when kernel n + 1 starts, kernel n - 1 is
// complete (n + 1 only ever overlaps n, and only in its prologue). One exception: quantize.cu's quantize_fold_early
// triggers before its wait, so the int8 decode GEMV after it (whose prologue reads only weights) may overlap the
// kernel before it too. Without the attribute both are no-ops.
// Every fllama kernel calls pdl_enter() (or the two steps, with weight loads between) before any other
// global memory access.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// When a kernel lets the next one start: 0 never explicitly (at block exit), 1 right after its wait, 2 as 1
// but the GEMVs only after their main loop, 3 as 2 but decode attention at block exit, 4 (the default) as 3
// except in a decode step of up to FLLAMA_PDL_EARLY_ROWS rows, where the GEMVs and attention trigger right after
// their wait as in 1. Why split by rows: a dependent launched early places its blocks on whichever SMs have room,
// and a GEMV crowded onto the SMs a long kernel leaves free streams through too few of them (early triggers cost
// a few % at 8-32 rows); at a few rows the kernels are short, and their dependents' prefetch (weights,
// attention's K/V, issued before their wait) fills the tail instead (a few % gained).
#ifndef FLLAMA_PDL_TRIGGER
#define FLLAMA_PDL_TRIGGER 4
#endif
#ifndef FLLAMA_PDL_EARLY_ROWS
#define FLLAMA_PDL_EARLY_ROWS 4
#endif

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && FLLAMA_PDL_TRIGGER > 0
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Trigger 4's small decode steps: up to FLLAMA_PDL_EARLY_ROWS rows, whose kernels trigger right after their wait.
__device__ __forceinline__ bool pdl_early_rows(int rows) {
    return FLLAMA_PDL_TRIGGER == 4 && rows <= FLLAMA_PDL_EARLY_ROWS;
}

// The GEMVs' two trigger points (after the wait / after the main loop); rows: the GEMV's M.
__device__ __forceinline__ void pdl_gemv_started(int rows) {
    if (FLLAMA_PDL_TRIGGER == 1 || pdl_early_rows(rows)) pdl_launch_dependents();
}
__device__ __forceinline__ void pdl_gemv_streamed() {
    if (FLLAMA_PDL_TRIGGER >= 2) pdl_launch_dependents();
}

// Decode attention: its wait, and its trigger unless the dependents wait for its blocks to exit (3; 4 beyond
// FLLAMA_PDL_EARLY_ROWS rows). rows: the batch's rows.
__device__ __forceinline__ void pdl_enter_attention(int rows) {
    pdl_wait();
    if (FLLAMA_PDL_TRIGGER < 3 || pdl_early_rows(rows)) pdl_launch_dependents();
}

__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// Thread-block clusters (sm_90): the cluster's barrier, every thread of every block (release: this block's
// shared-memory writes are visible to the cluster after it; acquire: the others' are visible here), and the
// address in block `rank`'s shared memory that `local` has in this block (same kernel, same layout). Below sm_90 they
// compile to a trap: the launchers take the cluster entries only where the GPU has clusters.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FLLAMA_CLUSTER_ASM(...) __trap()
#else
#define FLLAMA_CLUSTER_ASM(...) asm volatile(__VA_ARGS__)
#endif
__device__ __forceinline__ void cluster_sync() {
    FLLAMA_CLUSTER_ASM("barrier.cluster.arrive.release;\n" ::: "memory");
    FLLAMA_CLUSTER_ASM("barrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, uint32_t rank) {
    uint32_t remote = 0;
    FLLAMA_CLUSTER_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}
// A generic pointer to what `p` points at in block `rank` of the cluster (loads, stores and atomics reach it).
template <typename X>
__device__ __forceinline__ X* cluster_ptr(X* p, int rank) {
    unsigned long long r = 0;
    FLLAMA_CLUSTER_ASM("mapa.u64 %0, %1, %2;\n" : "=l"(r) : "l"(p), "r"(rank));
    return reinterpret_cast<X*>(r);
}
// The two halves of cluster_sync, for a barrier phase that only says "every block has started" (relaxed: it orders
// no memory) or whose waiters are a subset of the cluster. The wait counts only threads that have not exited
// (PTX ISA, barrier.cluster), so a block may arrive and exit, or exit without arriving.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    FLLAMA_CLUSTER_ASM("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
    FLLAMA_CLUSTER_ASM("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    FLLAMA_CLUSTER_ASM("barrier.cluster.wait.acquire;\n" ::: "memory");
}
// A float into block `rank`'s shared memory at the address `p` has in this block.
__device__ __forceinline__ void st_cluster(float* p, int rank, float v) {
    const uint32_t remote = cluster_map((uint32_t)__cvta_generic_to_shared(p), rank);
    FLLAMA_CLUSTER_ASM("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(v) : "memory");
}

// mbarriers (shared memory, 8 bytes; sm_90, traps below like the cluster helpers): a barrier's phase completes once
// `count` arrivals have come and the bytes announced by expect_tx have landed; waiters name the phase by its parity
// (0 first). A wait on parity 1 before any phase completed returns at once, which lets a producer pass its first
// round of "slot empty" waits without the consumers' arrivals.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    FLLAMA_CLUSTER_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Release semantics: this thread's earlier shared-memory writes are visible to whoever waits the phase out.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    FLLAMA_CLUSTER_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Relaxed: for a consumer whose wgmma reads of the slot are complete once wgmma.wait_group returned; a release would
// make the arriving lane wait for its own global loads in flight and orders nothing the producer needs.
__device__ __forceinline__ void mbar_arrive_relaxed(uint32_t bar) {
    FLLAMA_CLUSTER_ASM("mbarrier.arrive.relaxed.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    FLLAMA_CLUSTER_ASM("{\n.reg .pred done;\nWAIT:\n"
                       "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                       "@!done bra WAIT;\n}\n" ::"r"(bar),
                       "r"(parity)
                       : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    FLLAMA_CLUSTER_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Cluster push: blocks store values into block `rank`'s shared memory with st.async, each store completing its
// bytes on that block's mbarrier `bar` (the address it has in this block), and the owner waits on the barrier for
// the bytes it expects. Neither side needs a fence or a cluster barrier after the stores (a release arrival on the
// cluster barrier is a GPU-scope MEMBAR). The owner initializes the barrier (mbar_init_cluster) before a cluster
// barrier phase that the pushing blocks wait out before their first store.
__device__ __forceinline__ void mbar_init_cluster(uint32_t bar, int count) {
    mbar_init(bar, count);
    FLLAMA_CLUSTER_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Four (two) floats at p, 16- (8-) byte aligned.
__device__ __forceinline__ void st_async_cluster4(float* p, int rank, float4 v, uint32_t bar) {
    const uint32_t remote = cluster_map((uint32_t)__cvta_generic_to_shared(p), rank);
    FLLAMA_CLUSTER_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
                       ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                       "r"(__float_as_uint(v.w)), "r"(cluster_map(bar, rank))
                       : "memory");
}
__device__ __forceinline__ void st_async_cluster2(float* p, int rank, float2 v, uint32_t bar) {
    const uint32_t remote = cluster_map((uint32_t)__cvta_generic_to_shared(p), rank);
    FLLAMA_CLUSTER_ASM("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n"
                       ::"r"(remote), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(cluster_map(bar, rank))
                       : "memory");
}

}  // namespace fllama
