// Embedding lookup: out[t, :] = table[ids[t], :] for an fp16 table [V, H], 16-byte vectors.
// One block per token; an id outside [0, V) yields a row of zeros (the kernel cannot raise, and a
// device-side check keeps a bad id from reading outside the table).
// Entry points embedding_i32 / embedding_i64(out fp16 [T,H], table fp16 [V,H], ids [T], int V, int H)
#include "common.cuh"

using namespace fllama;

template <typename Id>
__device__ __forceinline__ void embedding_row(__half* __restrict__ out, const __half* __restrict__ table,
                                              const Id* __restrict__ ids, int V, int H) {
    const size_t t = blockIdx.x;
    const long long id = (long long)ids[t];
    const bool valid = id >= 0 && id < V;
    const uint4* src = reinterpret_cast<const uint4*>(table + (valid ? id : 0) * (size_t)H);
    uint4* dst = reinterpret_cast<uint4*>(out + t * (size_t)H);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) dst[c] = valid ? src[c] : zero;
}

extern "C" __global__ void embedding_i32(__half* out, const __half* table, const int32_t* ids, int V, int H) {
    pdl_enter();
    embedding_row<int32_t>(out, table, ids, V, H);
}

extern "C" __global__ void embedding_i64(__half* out, const __half* table, const int64_t* ids, int V, int H) {
    pdl_enter();
    embedding_row<int64_t>(out, table, ids, V, H);
}
