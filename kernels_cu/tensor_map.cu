// A TMA tensor map written into device memory by a kernel (tensor_map.py, device_map under CUDA-graph capture).
//   dst uint64 [16] (128 bytes, 64-byte aligned) <- the map's 16 words, passed by value.
// Why a kernel: during capture the map of a buffer the capture allocates cannot be uploaded with a copy from
// host memory, but a kernel's parameters are captured by value, so each replay writes the same map again,
// ahead of the GEMM that reads it (which launches only once this grid has exited: no early trigger here).
#include "common.cuh"

using namespace fllama;

extern "C" __global__ void __launch_bounds__(32)
    put_map(unsigned long long* dst, unsigned long long w0, unsigned long long w1, unsigned long long w2,
            unsigned long long w3, unsigned long long w4, unsigned long long w5, unsigned long long w6,
            unsigned long long w7, unsigned long long w8, unsigned long long w9, unsigned long long w10,
            unsigned long long w11, unsigned long long w12, unsigned long long w13, unsigned long long w14,
            unsigned long long w15) {
    pdl_wait();  // a kernel still running before this one may be reading the same buffer
    const unsigned t = threadIdx.x;  // word t of the map, selected without an array (which would go to the stack)
    const unsigned long long lo = t < 4 ? (t < 2 ? (t ? w1 : w0) : (t == 2 ? w2 : w3))
                                        : (t < 6 ? (t == 4 ? w4 : w5) : (t == 6 ? w6 : w7));
    const unsigned long long hi = t < 12 ? (t < 10 ? (t == 8 ? w8 : w9) : (t == 10 ? w10 : w11))
                                         : (t < 14 ? (t == 12 ? w12 : w13) : (t == 14 ? w14 : w15));
    const unsigned long long v = t < 8 ? lo : hi;
    if (threadIdx.x < 16) dst[threadIdx.x] = v;
    // the release half of the proxy hand-off; the GEMM acquires before its first TMA (awq_wgmma.cu)
    asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
}
