// W8A8 GEMM with the dequant epilogue: y[m, n] = fp16((float(acc) * a_scale[m]) * w_scale[n]) (+ residual),
// acc[m, n] = sum_k q_x[m, k] * qweight[n, k] in exact int32.
//
// int8_gemv_mt{1,2}[_res]: the decode kernel (memory-bound; every weight byte is read once per 8*MT tokens).
//   Block = 8 warps owning 16 output channels; the warps split K and meet in shared memory.
//   Per 64-wide k tile a lane loads 16 bytes of weight row g and of row g + 8 and 16 bytes of activation
//   row g (per 8-token tile) and feeds two m16n8k32 s8 mma: the weights are the A operand (16 channels),
//   the tokens the B operand (8 tokens), so D = y^T and M <= 8 wastes no weight bandwidth. The lane's 16
//   contiguous bytes are split 8 + 8 over the two mma (a0/a2 = bytes 0-3/4-7 then 8-11/12-15), and the
//   activations are split the same way, which is all the dot product needs.
//   grid (ceil(N / 16), ceil(M / (8 * MT))), block 256.
// int8_dequant[_res]: the epilogue alone, for the int32 product of torch._int_mm (prefill);
//   4 columns per thread, grid ceil(M * N / 4 / 256), block 256.
#include "gemm_common.cuh"

using namespace fllama;

namespace {

constexpr int WARPS = 8;
constexpr int UNROLL = 4;  // 64-wide k tiles in flight per warp: 8 x 16-byte weight loads per lane
constexpr int TILE_K = 64;

template <int MT, bool RESIDUAL>
__device__ __forceinline__ void int8_gemv(__half* __restrict__ y, const int8_t* __restrict__ qx,
                                          const float* __restrict__ a_scale, int a_stride,
                                          const int8_t* __restrict__ qweight, const float* __restrict__ w_scale,
                                          const __half* __restrict__ residual, int M, int N, int K) {
    __shared__ int red[WARPS][MT][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const int m0 = blockIdx.y * 8 * MT;

    const bool lo_ok = n0 + g < N, hi_ok = n0 + g + 8 < N;
    const int8_t* w_lo = qweight + (size_t)(lo_ok ? n0 + g : 0) * K + 16 * t;
    const int8_t* w_hi = qweight + (size_t)(hi_ok ? n0 + g + 8 : 0) * K + 16 * t;
    bool x_ok[MT];
    const int8_t* x_row[MT];
    token_rows<MT>(qx, M, K, m0, g, 16 * t, x_ok, x_row);

    int acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[mt][r] = 0;

    gemv_mainloop<WARPS, UNROLL, TILE_K>(w_lo, w_hi, lo_ok, hi_ok, x_row, x_ok, K, 16 * t, warp, acc,
                                         [](auto& c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                            uint32_t b1) { mma_s8_16832(c, a0, a1, a2, a3, b0, b1); });

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[warp][mt][r][lane] = acc[mt][r];
    __syncthreads();

    // MT * 128 partial sums per warp; 256 threads take one each (MT <= 2).
    if (threadIdx.x >= MT * 128) return;
    const int mt = threadIdx.x >> 7, r = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
    int sum = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += red[w][mt][r][l];
    const int n = n0 + (l >> 2) + (r >= 2 ? 8 : 0);
    const int m = m0 + mt * 8 + 2 * (l & 3) + (r & 1);
    if (n < N && m < M) {
        const size_t o = (size_t)m * N + n;
        y[o] = int8_epilogue(sum, a_scale[(size_t)m * a_stride], w_scale[n], RESIDUAL ? residual + o : nullptr);
    }
}

template <bool RESIDUAL>
__device__ __forceinline__ void int8_dequant(__half* __restrict__ y, const int* __restrict__ acc,
                                             const float* __restrict__ a_scale, int a_stride,
                                             const float* __restrict__ w_scale,
                                             const __half* __restrict__ residual, int M, int N) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;  // N % 4 == 0
    if (i >= (size_t)M * N) return;
    const int m = (int)(i / N), n = (int)(i % N);
    const int4 a = *reinterpret_cast<const int4*>(acc + i);
    const float4 ws = *reinterpret_cast<const float4*>(w_scale + n);
    const float as = a_scale[(size_t)m * a_stride];
    __half h[4];
    h[0] = int8_epilogue(a.x, as, ws.x, RESIDUAL ? residual + i : nullptr);
    h[1] = int8_epilogue(a.y, as, ws.y, RESIDUAL ? residual + i + 1 : nullptr);
    h[2] = int8_epilogue(a.z, as, ws.z, RESIDUAL ? residual + i + 2 : nullptr);
    h[3] = int8_epilogue(a.w, as, ws.w, RESIDUAL ? residual + i + 3 : nullptr);
    *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(h);
}

}  // namespace

// Arguments of every gemv entry: (y fp16 [M,N], q_x int8 [M,K], a_scale f32 [M or 1], int a_stride (1 or 0),
//   qweight int8 [N,K], w_scale f32 [N], residual fp16 [M,N] or null, int M, int N, int K)
#define FLLAMA_INT8_GEMV(NAME, MT, RES)                                                                    \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        NAME(__half* y, const int8_t* qx, const float* a_scale, int a_stride, const int8_t* qweight,      \
             const float* w_scale, const __half* residual, int M, int N, int K) {                          \
        int8_gemv<MT, RES>(y, qx, a_scale, a_stride, qweight, w_scale, residual, M, N, K);                 \
    }

FLLAMA_INT8_GEMV(int8_gemv_mt1, 1, false)
FLLAMA_INT8_GEMV(int8_gemv_mt2, 2, false)
FLLAMA_INT8_GEMV(int8_gemv_mt1_res, 1, true)
FLLAMA_INT8_GEMV(int8_gemv_mt2_res, 2, true)

// (y fp16 [M,N], acc int32 [M,N], a_scale f32 [M or 1], int a_stride, w_scale f32 [N], residual or null, M, N)
#define FLLAMA_INT8_DEQUANT(NAME, RES)                                                                     \
    extern "C" __global__ void __launch_bounds__(256)                                                      \
        NAME(__half* y, const int* acc, const float* a_scale, int a_stride, const float* w_scale,         \
             const __half* residual, int M, int N) {                                                       \
        pdl_enter();                                                                                       \
        int8_dequant<RES>(y, acc, a_scale, a_stride, w_scale, residual, M, N);                             \
    }

FLLAMA_INT8_DEQUANT(int8_dequant, false)
FLLAMA_INT8_DEQUANT(int8_dequant_res, true)
