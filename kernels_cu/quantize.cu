// Per-token int8 quantization of an fp16 matrix [T, K] (the o_proj input), one block per row.
//   dynamic: amax = max|x| over the row, a_scale[t] = amax / 127
//   static:  amax = *static_amax (one fp32 on the device, so a captured graph keeps reading it),
//            a_scale[t] = amax / 127 as well, so the int8 GEMM always reads a per-row scale
//   q = clamp(rint(x * (127 / amax)), -127, 127), amax clamped to >= 1e-8 (IEEE division, no fast math)
// Entry points quantize_<dyn|static>_nv<NV>(q int8 [T,K], a_scale f32 [T], static_amax f32 [1],
//                                          x fp16 [T,K], int K)
// quantize_fold(q int8 [T,K], a_scale f32 [T], mx f32 [T,C], sq f32 [T,C] or null, static_amax f32 [1] or null,
// x fp16 [T,K], int K, float eps, int C, zero f32 [T] or null): the RMSNorm before an int8 GEMM deferred into its
// producer (norm_fold.py), or with sq null quantize()'s bits from C partial maxima that a previous kernel wrote
// (silu_mul_part's per block, the int8 SwiGLU GEMV's per 8 channels); grid (ceil(K / 1024), T), 8 values a thread.
// zero, when given, is set to 0 (the next GEMV's row-max accumulator).
#include "row_quant.cuh"

using namespace fllama;

#define FLLAMA_QUANTIZE_ENTRY(NAME, NV, QMODE)                                                          \
    extern "C" __global__ void FLLAMA_ROW_BOUNDS(NV)                                                 \
        quantize_##NAME##_nv##NV(int8_t* q, float* a_scale, const float* static_amax, const __half* x, \
                                 int K) {                                                               \
        pdl_enter();                                                                                    \
        quantize_row<Int8Rule, NV, QMODE>(reinterpret_cast<uint8_t*>(q), a_scale, static_amax, x, K); \
    }

#define FLLAMA_QUANTIZE_VARIANTS(NV)                 \
    FLLAMA_QUANTIZE_ENTRY(dyn, NV, QUANT_DYNAMIC)    \
    FLLAMA_QUANTIZE_ENTRY(static, NV, QUANT_STATIC)

FLLAMA_ROW_WIDTHS(FLLAMA_QUANTIZE_VARIANTS)

constexpr int PARTS_THREADS = 128;

// The int8 deferred RMSNorm (norm_fold.py): x is xg = fp16(h * w) and mx / sq the maxima of |xg| and sums of h^2
// over C channel groups that its producer wrote (int8_gemm.cu's Int8Fold). LlamaRMSNorm's output is rstd * xg up
// to one fp16 rounding, rstd = 1 / sqrt(sum / K + eps): dynamic, its codes are xg's by xg's own max (rstd > 0
// cancels) and a_scale = amax / 127 * rstd; static, the codes of rstd * xg by the static amax. Replaces
// rmsnorm_quant's one block and its chain of reductions (the row, then rstd, then the max): here every block of
// the row reduces all C partials in one round trip beside its x loads, in a fixed order (every block gets the
// same rstd), then quantizes its 1024 values. sq null: no norm (rstd = 1), so q and a_scale are quantize()'s
// bits (the max of the partial maxima is the row's max).
// EARLY (quantize_fold_early): the dependents may launch before this kernel's wait, i.e. while the kernel before it
// still runs. Only for a dependent that reads nothing but weights before its own wait (the int8 decode GEMVs: their
// wait returns once this kernel, and so the one before it, has completed): their weight prefetch then streams
// under the producer GEMV's tail, which a 1.4 us kernel in between otherwise leaves idle.
template <bool EARLY>
__device__ __forceinline__ void quantize_fold_rows(int8_t* __restrict__ q, float* __restrict__ a_scale,
                                                   const float* __restrict__ mx, const float* __restrict__ sq,
                                                   const float* __restrict__ static_amax,
                                                   const __half* __restrict__ x, int K, float eps, int C,
                                                   float* __restrict__ zero) {
    __shared__ float s_max[PARTS_THREADS / 32], s_sum[PARTS_THREADS / 32];
    if (EARLY) {
        pdl_launch_dependents();
        pdl_wait();
    } else {
        pdl_enter();
    }
    const size_t row = blockIdx.y;
    // zero: the next kernel's row-max accumulator (the int8 SwiGLU GEMV's row_amax), cleared for it here, after
    // the wait, where its last reader (the down_proj before) has completed and its writers have not started
    if (zero != nullptr && blockIdx.x == 0 && threadIdx.x == 0) zero[row] = 0.0f;
    const int c = blockIdx.x * PARTS_THREADS + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Half8 v;
    if (c < K / 8) v = load_half8(x + row * K + 8 * c);  // in flight while the partials are read
    float amax = 0.0f, sum = 0.0f;
    const float* pm = mx + row * C;
    const float* ps = sq != nullptr ? sq + row * C : nullptr;  // read only with sq
#pragma unroll 4
    for (int i = threadIdx.x; i < C; i += PARTS_THREADS) {
        if (static_amax == nullptr) amax = fmaxf(amax, pm[i]);
        if (sq != nullptr) sum += ps[i];
    }
    amax = warp_max(amax);
    sum = warp_sum(sum);
    if (lane == 0) {
        s_max[warp] = amax;
        s_sum[warp] = sum;
    }
    __syncthreads();
    amax = 0.0f;
    sum = 0.0f;
#pragma unroll
    for (int w = 0; w < PARTS_THREADS / 32; ++w) {
        amax = fmaxf(amax, s_max[w]);
        sum += s_sum[w];
    }
    float inv, scale;
    fold_scales(amax, sum, sq != nullptr, static_amax, K, eps, inv, scale);
    if (c < K / 8) quantize_store8(q + row * K + 8 * c, v, inv);
    if (blockIdx.x == 0 && threadIdx.x == 0) a_scale[row] = scale;
}

// (q int8 [T,K], a_scale f32 [T], mx f32 [T,C], sq f32 [T,C] or null, static_amax f32 [1] or null, x fp16 [T,K],
//  int K, float eps, int C, zero f32 [T] or null (set to 0)); grid (ceil(K / 1024), T), block 128
#define FLLAMA_QUANTIZE_FOLD(NAME, EARLY)                                                                  \
    extern "C" __global__ void __launch_bounds__(PARTS_THREADS)                                            \
        NAME(int8_t* q, float* a_scale, const float* mx, const float* sq, const float* static_amax,       \
             const __half* x, int K, float eps, int C, float* zero) {                                     \
        quantize_fold_rows<EARLY>(q, a_scale, mx, sq, static_amax, x, K, eps, C, zero);                   \
    }
FLLAMA_QUANTIZE_FOLD(quantize_fold, false)
FLLAMA_QUANTIZE_FOLD(quantize_fold_early, true)
