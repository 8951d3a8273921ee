// SwiGLU activation: out = silu(gate) * up from the fused gate|up GEMM output gate_up [T, 2F]
// (gate = columns [0, F), up = columns [F, 2F)), one block per row, optionally quantized to int8.
// The row is silu_mul.cuh's (fp8_quantize.cu instantiates it on the fp8 rule). Numerics follow torch's
// F.silu(g) * u on fp16: silu computed in fp32 (g / (1 + exp(-g))), rounded
// to fp16, then an fp16 multiply; the int8 variants quantize that fp16 value with the rule in common.cuh.
// Entry points silu_mul_<plain|dyn|static>_nv<NV>(out fp16 [T,F], q int8 [T,F], a_scale f32 [T],
//                                               static_amax f32 [1], gate_up fp16 [T,2F], int F)
// silu_mul_interleaved(out fp16 [M,F], y fp16 [M,2F], int64 n_panels = M*F/8): the same math on swiglu_layout.py's
// interleaved columns (16-column panels of 8 gate then 8 up channels), one thread per panel.
// silu_mul_part_<dyn|static>(y fp16 [T,F], part f32 [T,C], q int8 [T,F], a_scale f32 [T], static_amax f32 [1],
//                            gate_up fp16 [T,2F], int F): the int8 variants for a few rows (silu_mul.py SPLIT_MAX_ROWS),
// a row over C blocks of PART_VALUES (see silu_mul_part).
#include "silu_mul.cuh"

using namespace fllama;

#define FLLAMA_SILU_ENTRY(NAME, NV, QMODE)                                                                  \
    extern "C" __global__ void FLLAMA_SILU_BOUNDS(NV)                                                    \
        silu_mul_##NAME##_nv##NV(__half* out, int8_t* q, float* a_scale, const float* static_amax,          \
                                 const __half* gate_up, int F) {                                            \
        pdl_enter();                                                                                        \
        silu_mul_row<NV, QMODE>(out, reinterpret_cast<uint8_t*>(q), a_scale, static_amax, gate_up, F);    \
    }

#define FLLAMA_SILU_VARIANTS(NV)                    \
    FLLAMA_SILU_ENTRY(plain, NV, QUANT_NONE)        \
    FLLAMA_SILU_ENTRY(dyn, NV, QUANT_DYNAMIC)       \
    FLLAMA_SILU_ENTRY(static, NV, QUANT_STATIC)

FLLAMA_SILU_WIDTHS(FLLAMA_SILU_VARIANTS)

// y's panel p (columns 16p..16p+15 of the flattened [M, 2F]) gives out's 8 values 8p..8p+7 of the flattened [M, F]:
// rows need no index arithmetic. Grid-stride, though the launcher starts a thread per panel.
extern "C" __global__ void __launch_bounds__(256)
    silu_mul_interleaved(__half* __restrict__ out, const __half* __restrict__ y, long long n_panels) {
    pdl_enter();
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < n_panels;
         p += (long long)gridDim.x * blockDim.x) {
        const Half8 g = load_half8(y + 16 * p);
        const Half8 u = load_half8(y + 16 * p + 8);
        store_half8(out + 8 * p, silu_mul8(g, u));
    }
}

// The int8 variants for a few rows. One block per row leaves all but T SMs idle while each thread walks 64 values;
// here a row is spread over blocks of 128 threads, 8 values each. Dynamic:
// each block stores its fp16 values and their absmax, and quantize.cu's quantize_fold finishes the row with the
// max of those maxima, which is the row's max exactly (the same bits as the one-block kernel). Static: the amax is
// known, so each block quantizes its own values (a_scale from block 0).
constexpr int PART_THREADS = 128;
template <int QMODE>
__device__ __forceinline__ void silu_mul_part(__half* __restrict__ y, float* __restrict__ part, int8_t* __restrict__ q,
                                              float* __restrict__ a_scale, const float* __restrict__ static_amax,
                                              const __half* __restrict__ gate_up, int F) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.y;
    const int c = blockIdx.x * PART_THREADS + threadIdx.x;  // this thread's 16-byte vector of the row
    const __half* gate = gate_up + row * (size_t)(2 * F);
    Half8 v;
    float amax = 0.0f;
    const bool in = c < F / 8;
    if (in) {
        const Half8 g = load_half8(gate + 8 * c);
        const Half8 u = load_half8(gate + F + 8 * c);
        v = silu_mul8(g, u);
        amax = half8_absmax(v);
    }
    if (QMODE == QUANT_STATIC) {
        float inv, scale;
        amax_scales(*static_amax, inv, scale);
        if (in) quantize_store8(q + row * (size_t)F + 8 * c, v, inv);
        if (blockIdx.x == 0 && threadIdx.x == 0) a_scale[row] = scale;
        return;
    }
    if (in) store_half8(y + row * (size_t)F + 8 * c, v);
    amax = block_max(amax, scratch);
    if (threadIdx.x == 0) part[row * gridDim.x + blockIdx.x] = amax;
}

#define FLLAMA_SILU_PART_ENTRY(NAME, QMODE)                                                                 \
    extern "C" __global__ void __launch_bounds__(PART_THREADS)                                             \
        silu_mul_part_##NAME(__half* y, float* part, int8_t* q, float* a_scale, const float* static_amax,  \
                             const __half* gate_up, int F) {                                                \
        pdl_enter();                                                                                        \
        silu_mul_part<QMODE>(y, part, q, a_scale, static_amax, gate_up, F);                                 \
    }
FLLAMA_SILU_PART_ENTRY(dyn, QUANT_DYNAMIC)
FLLAMA_SILU_PART_ENTRY(static, QUANT_STATIC)
