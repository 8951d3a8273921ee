// Lab (l2_hint.py): which L2 cache-policy forms of a weight stream run on this GPU, and whether a stream loaded
// evict_first leaves a small hot buffer (a decode step's code, KV and activations) in the L2.
#include "common.cuh"

using namespace fllama;

// 0 cp.async.cg, 1 the same with an evict_first policy, 2 with the policy and a src-size (zero fill),
// 3 ld.global.nc.L1::no_allocate with the policy, 4 ld.global.cs (streaming: evict-first in L1 and L2)
template <int FORM>
__device__ __forceinline__ void stream_words(const uint4* __restrict__ src, long long n16, unsigned* out) {
    __shared__ uint4 buf[256];
    pdl_enter();
    uint64_t pol = 0;
    if (FORM >= 1 && FORM <= 3) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(&buf[threadIdx.x]);
    unsigned acc = 0;
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n16; i += gridDim.x * 256ll) {
        uint4 v;
        if (FORM <= 2) {
            if (FORM == 0)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src + i), "r"(16));
            if (FORM == 1)
                asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src + i),
                             "l"(pol));
            if (FORM == 2)
                asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(s),
                             "l"(src + i), "r"(16), "l"(pol));
            asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
            v = buf[threadIdx.x];
        } else if (FORM == 3) {
            asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i), "l"(pol));
        } else {
            asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src + i));
        }
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) atomicAdd(out, acc);  // keeps the loads; (almost) never taken
}

#define L2_STREAM(FORM) \
    extern "C" __global__ void __launch_bounds__(256) stream_f##FORM(const uint4* src, long long n16, unsigned* out) { \
        stream_words<FORM>(src, n16, out);                                                                        \
    }
L2_STREAM(0)
L2_STREAM(1)
L2_STREAM(2)
L2_STREAM(3)
L2_STREAM(4)

// the hot buffer: one read of n16 words through the L2 (ld.global.cg), timed after a stream
extern "C" __global__ void __launch_bounds__(256) hot_read(const uint4* src, long long n16, unsigned* out) {
    pdl_enter();
    unsigned acc = 0;
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n16; i += gridDim.x * 256ll) {
        const uint4 v = __ldcg(src + i);
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) atomicAdd(out, acc);
}
