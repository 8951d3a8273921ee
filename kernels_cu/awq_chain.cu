// AWQ decode GEMVs chained in one persistent kernel (awq_chain.py): the o_proj, gate|up and down_proj of a
// layer and the next layer's q|k|v, each a phase, separated by grid barriers instead of kernel boundaries.
//
// Why: at batch 1 an AWQ layer's GEMVs stream at ~90% of the copy bandwidth once running, but each kernel also
// pays ~5 us that does not scale with its bytes (a linear fit of the four GEMVs' times against their bytes,
// docs/gpu.md step 13): its blocks become resident only as the previous kernel's exit, then wait a DRAM round
// trip for their first weights, and its last wave drains alone. Here every block stays resident: before it
// waits at a barrier it has already issued its first weights of the next phase (nothing a phase writes is a
// weight), so after the barrier only the activations, L2 hits, are still to come.
//
//   grid: every block resident at once (awq_chain.py sizes it from the occupancy query: 2 per SM by
//   __launch_bounds__; not a cooperative launch, which stream capture refuses), block = 8 warps on one
//   16-channel panel at a time (awq_gemv.cuh's body, as the _w8 entries), panels p = block, block + grid, ...
//   of each phase; while a panel reduces and stores, the next panel's (or the next phase's) first step of
//   weights is already loading.
//   phases (a compile-time order): 0 o_proj + residual, producer of the deferred ffn_norm; 1 gate|up with
//   SwiGLU, its consumer; 2 down_proj + residual, producer of the next norm; 3 (if phases == 4) the next
//   layer's q|k|v, its consumer. Each phase's result is bit for bit what awq_gemv.cu's entry computes.
//   M <= 8 tokens (one token tile), groups of 128 k.
#include "awq_gemv.cuh"
#include "grid_barrier.cuh"

using namespace fllama;

namespace {

constexpr int U = 2;  // tiles per warp step, as the _w8 entries
constexpr int W = 8;  // warps per panel
constexpr int GPT = 1;

// One GEMV of the chain: awq_gemv.cu's arguments (awq_chain.py packs them in this order).
struct Phase {
    __half* y;
    const __half* x;
    const uint32_t* packed;
    const uint32_t* terms;
    const __half* residual;
    int N, K, tiles;
    const __half* fold_w;
    __half* fold_xg;
    float* fold_part;
    const float* fold_in;
};
static_assert(sizeof(Phase) == 88, "awq_chain.py's PHASE_SIGNATURE packs 5 pointers, 3 ints, 4 pointers");

using Step = awq::Step<U, GPT>;

__device__ __forceinline__ void load_first(const Phase& p, int panel, Step& s) {
    awq::load_first<U, W, GPT>(p.packed, p.terms, panel, p.K, p.tiles, s);
}

// This block's panels of phase `p` (EPI its epilogue); `prefetch_next(s)` loads the first step of whatever the
// block does after the phase (the next phase's first panel) into s. `pre` holds this phase's first step.
template <int EPI, typename Next>
__device__ __forceinline__ void run_phase(const Phase& p, int M, float eps, Step& pre, bool last_phase,
                                          Next prefetch_next) {
    const int panels = p.N / 16;
    bool first = true;
    for (int panel = blockIdx.x; panel < panels; panel += gridDim.x) {
        const int next = panel + gridDim.x;
        if (!first) __syncthreads();  // the previous panel's epilogue has read `red`
        awq::gemv_panel<1, GPT, EPI, U, W, true>(
            p.y, p.x, p.packed, p.terms, p.residual, M, p.N, p.K, p.tiles, p.fold_w, p.fold_xg, p.fold_part,
            p.fold_in, eps, panel, 0, pre, first, [&](Step& s) {
                if (next < panels) {
                    load_first(p, next, s);
                } else {
                    if (last_phase) pdl_launch_dependents();  // the kernel after the chain may start its prologue
                    prefetch_next(s);
                }
            });
        first = false;
    }
    if (blockIdx.x >= panels) {  // no panel here: straight to the next phase's weights
        if (last_phase) pdl_launch_dependents();
        prefetch_next(pre);
    }
}

}  // namespace

// (Phase p0..p3 [awq_chain.py PHASE_SIGNATURE each], int phases (3 or 4), int M, float eps, uint32 *barrier)
extern "C" __global__ void __launch_bounds__(32 * W, 2)
    awq_chain_mt1_g1(Phase p0, Phase p1, Phase p2, Phase p3, int phases, int M, float eps, uint32_t* barrier) {
    Step pre;
    if (blockIdx.x < p0.N / 16) load_first(p0, blockIdx.x, pre);
    pdl_wait();  // p0's activations and residual come from the previous kernel
    auto nothing = [](Step&) {};
    auto phase1 = [&](Step& s) { if (blockIdx.x < p1.N / 16) load_first(p1, blockIdx.x, s); };
    auto phase2 = [&](Step& s) { if (blockIdx.x < p2.N / 16) load_first(p2, blockIdx.x, s); };
    auto phase3 = [&](Step& s) { if (phases == 4 && blockIdx.x < p3.N / 16) load_first(p3, blockIdx.x, s); };

    run_phase<1>(p0, M, eps, pre, false, phase1);
    uint32_t ticket = grid_arrive(barrier);
    grid_wait(barrier, ticket);
    run_phase<2>(p1, M, eps, pre, false, phase2);
    ticket = grid_arrive(barrier);
    grid_wait(barrier, ticket);
    run_phase<1>(p2, M, eps, pre, phases == 3, phase3);
    if (phases == 4) {
        ticket = grid_arrive(barrier);
        grid_wait(barrier, ticket);
        run_phase<0>(p3, M, eps, pre, true, nothing);
    }
}
