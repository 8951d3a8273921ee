"""Every knob of the kernels and the engine: one frozen dataclass, each field with the reason for its value.

An engine carries its Tuning (Engine(weights, cfg, tuning)) and puts it in force around everything it runs, so
the launchers it calls read the same one (`current()`); outside an engine the defaults are in force. A/B tools
build an engine with another Tuning (`Engine.variant`); tests of one launcher use `active(...)`. Kernel limits
(tile sizes, what a kernel was compiled for) are not knobs and stay beside their launchers.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Iterator


@dataclass(frozen=True)
class Tuning:
    # -- the decode step's plan (kernels_cu/engine/plan.py) --
    # fp16 decode steps up to this many rows defer their RMSNorms into the GEMVs (norm_fold.py): each consumer
    # GEMV's blocks pay for the reduction, which costs more than the norm kernels it saves beyond 8 rows.
    fold_max_rows_fp16: int = 8
    # AWQ likewise up to 4 rows: the int4 GEMVs' blocks are busier, so the reduction wins only at fewer rows.
    fold_max_rows_awq: int = 4
    # int8 decode steps defer their norms too (o_proj / down_proj write the next norm's inputs): one kernel fewer
    # per norm. Off only to compare rounding with the plain norm kernels (the deferred norm rounds differently).
    fold_int8: bool = True
    # int8 decode steps of up to this many rows defer the o_proj / down_proj input quantizations into those GEMVs
    # (dynamic activations): every block re-reads and quantizes the whole rows, so only one row gains.
    defer_quant_max_rows: int = 1
    # In such a step, o_proj quantizes attention's output itself (from each unit's max) instead of attention.
    defer_attention: bool = True
    # ... and down_proj quantizes the SwiGLU it gets from the gate|up GEMV's epilogue.
    defer_swiglu: bool = True
    # The SwiGLU GEMV writes each row's max (an atomic max) so down_proj's blocks read one float, not every
    # partial max from the same L2 lines at once.
    swiglu_row_amax: bool = True
    # Up to this many rows an int8 gate|up GEMV applies the SwiGLU in its epilogue and quantize_fold quantizes it:
    # one kernel fewer; at 16 rows the two-tile GEMV's longer epilogue costs more than the kernel saved (0: never).
    swiglu_int8_rows: int = 8
    # Up to this many rows the int8 step's quantize_fold lets the next GEMV launch before its own wait, so the
    # GEMV's weight prefetch runs under the producer's tail (0: never); beyond 8 rows the early launch costs.
    quant_fold_early_rows: int = 8
    # -- prefill graphs (kernels_cu/engine/graphs.py) --
    # A prefill of up to this many tokens (rows x length) is host-bound when eager (~25-80 us of host work a
    # kernel), so a shape seen twice is captured and replayed; longer prefills are GPU-bound and stay eager. fp8's
    # faster GEMMs leave 2,048 still host-bound (H100, LLaMA-2-7B: 30.1 ms replayed against 32.2 eager; fp16 48.1 / 48.3).
    prefill_graph_tokens: int = 2048
    # Each captured prefill keeps its own activation memory: keep only the most recently used few.
    prefill_graphs: int = 2
    # -- decode attention (attention_decode.py) --
    # Combine the split-sequence partials inside a thread-block cluster (distributed shared memory) on GPUs that
    # have clusters, instead of through a global workspace and a second pass.
    attention_clusters: bool = True
    # -- GPU sampling (sampling.py) --
    # Blocks a row's max/argmax pass runs over, as one thread-block cluster (sm_90; 0 or 1: one block a row): one
    # block walks 128k logits on one SM at ~12 instructions a token. H200, greedy at 128,256 tokens: 13.0 us on one
    # block, 5.5 on 8, 6.3 on 16; Llama-3-8B awq batch 1 +0.9% (8) / +0.7% (16), Llama-3.2-1B +1.6% / +1.4%. The radix
    # select and gather of top-k / top-p run over the cluster too: generate's defaults 21.3 us on 8 against 59.5 on
    # one block, top-p 0.9 35.9 against 91.4.
    sample_cluster_blocks: int = 8
    # ... for vocabularies of at least this many tokens. The greedy pass alone gains from ~40,000 (H200: 32,000 tokens
    # 5.2 us on one block against 5.5 on 8; 49,152: 6.6 against 4.3), but the launch serves every sampling config of
    # the graph, and the sampled ones gain at 32,000 too (a cluster's select and gather: 8 blocks walk 4,000 tokens
    # each where one walks 32,000).
    sample_cluster_min_vocab: int = 32_000
    # -- AWQ int4 linears (awq_gemv.py, awq_batch.py, awq_wgmma_decode.py, awq_gemm.py) --
    # Above this many rows the GEMV family re-reads the weight too often: dequantize once and use a GEMM.
    awq_gemv_max_m: int = 64
    # From this many rows the batch GEMM's panels share the activations through shared memory (awq_batch.cu),
    # cheaper than the GEMV's per-warp reads.
    awq_batch_min_m: int = 17
    # From this many rows on Hopper with groups of 128, the same on wgmma (awq_wgmma_decode.cu): its fragments are
    # converted once for all tokens; at 17-31 rows the conversion does not pay yet.
    awq_wgmma_decode_min_m: int = 32
    # ... and there only for wide outputs or much work (rows x K x N): elsewhere its blocks are too few to pull the
    # weight at DRAM rate (H200, 32 rows: Llama-3.2-1B q|k|v 2048 x 3072 11.2 us against the GEMV's 7.7; LLaMA-2-7B
    # down 11008 x 4096 27.1 against the batch GEMM's 25.5, but at 64 rows 40.0 against 45.0).
    awq_wgmma_decode_min_n: int = 12288
    # ... (rows x K x N: the fragments converted once serve many rows)
    awq_wgmma_decode_min_work: int = 2_500_000_000
    # The batch GEMM from this much work on; below it the GEMV, whose per-warp reads cost little on a small weight
    # (32 rows: Llama-3.2-1B o 2048 x 2048 5.6 us against 7.4; down 8192 x 2048 13.5 against the GEMV's 16.2).
    awq_batch_min_work: int = 2 ** 29
    # Above awq_gemv_max_m on Hopper with groups of 128: the fused wgmma GEMM (as fast as cuBLAS fp16 and no w_hat
    # pass) instead of dequantize + cuBLAS.
    awq_fused_prefill: bool = True
    # One-row-tile GEMV warps per panel: 16-warp blocks for one row where the panels are at most one a SM and K is
    # more than one step of the 8-warp block (twice its tiles in flight: H200, Llama-3.2-1B's down_proj, batch 1
    # +2.6%; at 8 rows -1.2%; not its o_proj, one step either way, where the block's registers, a whole SM's, keep
    # gate|up from starting early) ...
    awq_sixteen_warp_one_block: bool = True
    # ... 2-warp blocks where their one wave holds at least this many warps a SM
    # (a sparser wave leaves bandwidth unused; above 16: never).
    awq_two_warp_min_warps: int = 11
    # 1-warp blocks (one wave of them, no cross-warp reduction) only from this many rows: fewer rows leave each
    # warp too little math to hide its loads (above 8: never).
    awq_one_warp_min_rows: int = 8
    # Otherwise 4-warp blocks where their grid is one wave: a partial second wave of 8-warp blocks leaves SMs idle
    # (H200, Llama-3-8B q|k|v, 384 panels: one wave of 4-warp blocks against 1.45 of 8-warp ones, batch 1 +2.4%).
    awq_four_warp_one_wave: bool = True
    # Otherwise 8-warp blocks up to this many waves of 4-warp blocks, 4 warps beyond (large grids need no width).
    awq_wide_waves: float = 1.5
    # The AutoAWQ-layout GEMV (awq_gemm.cu) up to this many rows, then dequantize + cuBLAS.
    awq_gemm_max_m: int = 64
    # K splits of the batch GEMM: as many as keep the grid within this many blocks a SM (fills the SMs at 32
    # tokens: q|k|v 2 splits, o / down 4, gate|up 1) ...
    awq_batch_blocks_per_sm: int = 3
    # ... at most this many (each split adds a partial sum to reduce) ...
    awq_batch_max_splits: int = 4
    # ... each at least this many 128-k tiles (fewer leave the ring's pipeline no room to fill).
    awq_batch_min_tiles_per_split: int = 4
    # The wgmma decode GEMM's splits likewise: 1.5 waves of the two resident blocks its registers allow ...
    awq_wgmma_decode_blocks_per_sm: int = 3
    # ... at most this many splits ...
    awq_wgmma_decode_max_splits: int = 4
    # ... each at least this many 128-k tiles.
    awq_wgmma_decode_min_tiles_per_split: int = 4
    # -- int8 GEMVs (int8_gemm.py) --
    # Plain int8 products (no deferred norm, no SwiGLU epilogue) of up to this many rows and outputs run the GEMV
    # (its 16-row tiles re-read the weight, from L2) instead of torch._int_mm + the dequant kernel (H200, 32 rows:
    # Llama-3.2-1B down 8192 x 2048 12.2 us against 21.0, o 5.2 against 8.7; wider outputs fill cuBLAS's tiles).
    int8_gemv_max_m: int = 32
    # ... (outputs: the GEMV's grid is one block per 16 outputs, cuBLAS's tiles fill a wide N better)
    int8_gemv_max_n: int = 4096
    # One row is quantized in the deferred GEMV's main loop, tile by tile, not in a prologue every block runs
    # behind a barrier before its first mma (the same codes).
    xq_row_loop: bool = True
    # One row of an int8 deferred RMSNorm is quantized by the GEMV after it, from the producer's partials, not by
    # a quantize_fold kernel in between (the same codes).
    norm_row_loop: bool = True
    # -- FP8 E4M3 linears (fp8_gemm.py) --
    # Up to this many rows the fp8 GEMV, above it the wgmma GEMM (Hopper): the GEMV's token tiles of a panel are
    # neighbouring blocks that read its lines from DRAM about once (the int8 lm_head GEMV's bound, same grid and
    # bytes). At 17-64 rows the GEMM has one 128-row tile a column, so ceil(N / 256) blocks: 16-86 for LLaMA-2-7B's
    # linears on 132 SMs, too few to pull the weight at DRAM rate, where the GEMV has N / 16 panels.
    fp8_gemv_max_m: int = 64
    # Token rows an fp8 GEMV block takes above 16 rows: 32 (one block a panel at the batch-32 step, which converts
    # each weight fragment to fp16 once for all of them; 16-row blocks convert it once each) or 16 (H200, a
    # LLaMA-2-7B layer's four GEMVs at 32 rows: 90.8 us against 107.9).
    fp8_gemv_block_rows: int = 32
    # ... and whether such 32-row blocks convert the weights on the integer pipe (fp8_gemv_mt4a: 16 channels a block,
    # whatever fp8_gemv_block_channels says; the same sums), leaving the conversion pipe to the activations: slower
    # on the H200 (103.7 us against 90.8).
    fp8_gemv_alu_weights: bool = False
    # Output channels such a 32-row block owns: 16 (fp8_gemv_mt4) or 32 (fp8_gemv_w2x*: each warp two panels, the
    # step's token rows staged beside its weight lines in shared memory, so each converted activation serves both and
    # a block reads as many activation bytes from L2 as weight bytes, not twice; Hopper-sized shared memory, else
    # mt4). H100, a LLaMA-2-7B layer's four at 32 rows: 94.3 us against 103.8; the engine at batch 32 +4.2%.
    fp8_gemv_block_channels: int = 32
    # ... and whether, where their grid exceeds the SMs (q|k|v, gate|up), they run as 4-warp blocks two a SM, so that
    # one block's pipeline fill and epilogue run under the other's loads, or as 8-warp blocks one a SM (H100, gate|up
    # at 32 rows: 40.3 us against 43.7).
    fp8_gemv_wide_two_blocks: bool = True
    # Whether the deferred chain's fp8_quantize_fold writes its codes as fp16 values for GEMVs of 2-64 rows that then
    # convert only the weights (fp8_gemv_h*: 16-row blocks), instead of codes the GEMV converts per token tile:
    # slower on the H200 (135.0 us against 90.8; the engine at batch 32 -16.5%).
    fp8_gemv_fp16_x: bool = False
    # Above fp8_gemv_max_m on Hopper: cuBLASLt's fp8 GEMM (torch._scaled_mm, row-wise fp32 scales, fp16 out, exact
    # accumulation) where the device's torch takes those scales, the residual and SwiGLU after it; else the wgmma
    # kernel (fp8_wgmma.cu, epilogues fused). H200, 2048 rows: ~1,130 TFLOP/s per-tensor against the kernel's ~900.
    fp8_prefill_library: bool = True
    # From this many rows the fp8 linears run cuBLASLt's GEMM (as above, where it takes the contract) instead of the
    # GEMV, below fp8_gemv_max_m too; such steps run the norm kernels, not the chain. cuBLASLt takes ~105-110 us for
    # a LLaMA-2-7B layer's four at 8-64 rows, the GEMV 64 / 72 / 91 / 161 us at 8 / 16 / 32 / 64 (H200; the engine
    # on cuBLASLt: batch 32 -12%, batch 64 +22%). 65: never.
    fp8_library_min_m: int = 33
    # Beyond the GEMV's rows the RMSNorm and SwiGLU kernels before an fp8 linear write its e4m3 codes themselves
    # (fp8_quantize.fp8_rmsnorm / fp8_silu_mul: the same bits as the fp16 kernel + fp8_quantize), and the norm kernel
    # adds the residual of the linear before it: a LLaMA-2-7B layer at 2,048 tokens 73.0 us against 115.3 (H200).
    fp8_fused_quant: bool = True
    # Up to this many rows an fp8 GEMV quantizes its fp16 input itself (fp8_gemv_xq, the same codes): no quantize
    # kernel before it, but every block re-reads the rows to find their max, which only one row does more cheaply
    # than the kernel it saves (int8's defer_quant_max_rows holds the same trade; 0: never).
    fp8_xq_max_rows: int = 1
    # fp8 decode steps up to this many rows run int8's deferred chain (engine/plan.py; 0: never): o_proj / down_proj
    # write the next norm's inputs, and the inputs of q|k|v and gate|up (that norm) and of o_proj and down_proj are
    # quantized from the maxima (and sums) their producers wrote: in the GEMV at one row (no block reads a whole row
    # for its scale), by fp8_quantize_fold above (a row over several blocks, where rmsnorm and fp8_quantize take one
    # block a row and two kernels). The norm then rounds as int8's fold does (one fp16 rounding fewer). H200: a
    # layer's GEMVs at one row 63.6 us against 71.5; fp8_quantize_fold 1.8-2.7 us against rmsnorm + fp8_quantize's 3.9.
    fp8_defer_max_rows: int = 64
    # On Hopper, fp8 products of fp8_wgmma_decode_min_m rows up to the GEMV's / cuBLASLt's limits and at least
    # fp8_wgmma_decode_min_n channels run the wgmma decode GEMM (fp8_wgmma_decode.cu: the tensor cores read e4m3 from
    # shared memory), not the GEMV, whose conversion of every code to fp16 costs more than its weight bytes at 32
    # rows. H200, LLaMA-2-7B at 32 rows: q|k|v 16.7 us against 21.3, gate|up 27.7 against 33.5; the engine +6.5% at
    # batch 17 and 32 (fp8 / fp16 at batch 32: 1.31x). Off: the GEMV.
    fp8_wgmma_decode: bool = True
    # ... from this many rows: the bucket-32 steps. At 16 rows it wins alone too (q|k|v 16.6 us against 19.1, gate|up
    # 27.4 against 29.2) but the engine at batch 16 gains 0.5%, within noise; at 8 rows it loses (the engine -1.9%).
    fp8_wgmma_decode_min_m: int = 17
    # ... for products this wide: o_proj and down_proj (4096 channels: 64 column blocks, too few to stream the weight
    # without K splits and their workspace) keep the GEMV (32 rows: 14.4 us against 8.1, down 23.2 against 15.5).
    fp8_wgmma_decode_min_n: int = 12288
    # Its K splits where the column blocks leave SMs without one: as many as fill this many resident blocks a SM
    # (its registers and ring allow three) ...
    fp8_wgmma_decode_blocks_per_sm: int = 3
    # ... at most this many (each adds a partial tile to the workspace) ...
    fp8_wgmma_decode_max_splits: int = 8
    # ... each at least this many 128-k tiles (fewer leave its 6-stage ring no room to fill).
    fp8_wgmma_decode_min_tiles_per_split: int = 4
    # -- SwiGLU (silu_mul.py) --
    # Up to this many rows the int8 SwiGLU spreads each row over blocks: one block per row would leave all but a
    # few SMs idle (0: never).
    silu_split_max_rows: int = 64
    # -- RoPE + KV write (rope_kv.py) --
    # Heads (of one token, one 16-dim chunk pair) each rope_kv thread takes, 1-4: all their loads are issued before
    # any math, so 4 keep 128 bytes a thread in flight at 63 registers (80: 8-bit caches), 3-4 blocks of 256 a SM.
    # H200, LLaMA-2-7B at 2,048 tokens: 30.2 us at 4, 30.5 at 3, 31.2 at 2, 36.6 at 1 (int8 cache 31.2 / 42.6 at 1).
    rope_heads_per_thread: int = 4
    # -- the int8 lm_head (fp16_gemv.py) --
    # Up to this many rows the int8-weight GEMV: a panel's 16-row tiles read the weight from DRAM about once;
    # dequantizing the head for cuBLAS each step would move more bytes than it saves.
    w8a16_gemv_max_m: int = 64
    # Up to this K, one token tile runs in 4-warp blocks (six a SM): at 8 warps a 2,048-k row is one 4-tile step a
    # warp, so each block streams once and exits, and its relaunch and reduction leave the SM's ring idle (0: never).
    w8a16_four_warp_max_k: int = 2048

    def __post_init__(self):
        if not 0 <= self.sample_cluster_blocks <= 16:  # H100 / H200's largest cluster
            raise ValueError(f"sample_cluster_blocks must be in [0, 16], got {self.sample_cluster_blocks}")
        if not 1 <= self.rope_heads_per_thread <= 4:  # rope_kv.cu's ROPE_MAX_HEADS
            raise ValueError(f"rope_heads_per_thread must be in [1, 4], got {self.rope_heads_per_thread}")
        if self.sample_cluster_min_vocab < 0:
            raise ValueError(f"sample_cluster_min_vocab must be >= 0, got {self.sample_cluster_min_vocab}")


DEFAULT = Tuning()
_CURRENT: ContextVar[Tuning] = ContextVar("fllama_tuning", default=DEFAULT)


def current() -> Tuning:
    """The Tuning in force: the running engine's, or DEFAULT."""
    return _CURRENT.get()


@contextmanager
def active(tuning: Tuning) -> Iterator[Tuning]:
    """Put `tuning` in force for the launches inside the block (an engine does this around each of its calls)."""
    token = _CURRENT.set(tuning)
    try:
        yield tuning
    finally:
        _CURRENT.reset(token)


@contextmanager
def override(**changes: object) -> Iterator[Tuning]:
    """The Tuning in force with some fields changed, for the block (tests and lab tools of one launcher)."""
    with active(replace(current(), **changes)) as t:
        yield t
