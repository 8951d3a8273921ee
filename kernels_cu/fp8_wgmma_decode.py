"""Launcher of fp8_wgmma_decode.cu: the FP8 E4M3 W8A8 GEMM of decode batches (17-64 token rows) on Hopper's wgmma.

    y[m, n] = fp16((acc * a_scale[m]) * w_scale[n])   (+ residual[m, n]),   acc = fp32 sum of x8[m, k] * w8[n, k]

fp8_gemm.cu's GEMV contract (fp8_contract.py; reference: fp8_wgmma_decode_ref), with its epilogues: plain, the
residual add (optionally writing the next RMSNorm's inputs, FoldOut in int8's format) and the SwiGLU of an
interleaved gate|up weight (optionally its maxima per 8 outputs, for the down_proj's fp8_quantize_fold). A block is 64
channels (wgmma's M) x BT = 32 or 64 tokens (wgmma's N): one consumer warpgroup and a producer warp that copies each
128-k stage of the weight by TMA and of the activations by cp.async; K is split over blocks only where the column
blocks leave SMs without one (the last block of a column sums the splits in order: deterministic).

fp8_gemm takes it (`runs`) on Hopper for tuning.fp8_wgmma_decode_min_m up to fp8_library_min_m - 1 rows and products
of at least tuning.fp8_wgmma_decode_min_n channels (q|k|v, gate|up): there it beats the GEMV, which converts every
code to fp16; the narrow o_proj / down_proj keep the GEMV (64 column blocks leave this kernel's pipelines short).

The weight's TMA map lives in device memory (tensor_map.py). `keep_weight_map` makes it before any graph capture and
every later launch on that weight finds it, under capture too, as long as its holder (the engine's Fp8Op) keeps it;
without one, a launch under capture writes the map by a put_map kernel in the graph and its weight copies wait for the
PDL wait. The activations need no map (cp.async), so the graph's own buffers work as they are.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kernels_cu import build, counters, norm_fold, tensor_map, tuning
from kernels_cu.checks import check_multiple, check_tensor, out_or_new
from kernels_cu.fp8_contract import CODES, check_act_scale, check_weight, fp8_gemm_ref, fp8_swiglu_ref
from kernels_cu.gemm_shapes import cdiv, sm_count
from kernels_cu.norm_fold import FoldOut

CHANNELS = 64  # a block's channels: wgmma's M (fp8_wgmma_decode.cu BN)
BK = 128  # k codes a stage (one 128-byte swizzled row of each operand)
THREADS = 160  # one consumer warpgroup and the producer warp
STAGES = {32: 6, 64: 4}  # ring slots per token tile (Shape<BT>::STAGES)
COUNTER_POOL = "fp8_wgmma_decode"
EPILOGUES = ("plain", "res", "silu")
# y, x8, a_scale, a_stride, wmap, w_scale, residual, fold_w, fold_xg, fold_sq, fold_mx, part, partial, counters,
# M, N, K, tiles_per_split, early
SIGNATURE = "PPPiPPPPPPPPPPiiiii"

# weight maps made by keep_weight_map, alive while their holders keep them: (device, address, shape) -> map
_kept: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def token_tile(m: int) -> int:
    """Tokens a block computes (wgmma's N): 32 up to 32 rows, 64 above."""
    return 32 if m <= 32 else 64


def smem_bytes(bt: int) -> int:
    """The ring (weight box 64 x 128 B + activation box bt x 128 B a slot), its two mbarriers a slot, the 1024-byte
    alignment of the swizzled boxes (Shape<BT>::SMEM)."""
    s = STAGES[bt]
    return s * (CHANNELS * BK + bt * BK) + 16 * s + 1024


def shape_fits(m: int, n: int, k: int, t: tuning.Tuning) -> bool:
    """Whether tuning t sends an fp8 product of m rows, n channels and k codes here (the GPU aside): the switch, the
    rows between fp8_wgmma_decode_min_m and the GEMV's / cuBLASLt's limits, wide products, whole 16-channel panels (the
    SwiGLU's, the fold's 8-channel groups) and 16-byte rows of codes (cp.async, TMA)."""
    rows = t.fp8_wgmma_decode_min_m <= m < t.fp8_library_min_m and m <= t.fp8_gemv_max_m
    return t.fp8_wgmma_decode and rows and n >= t.fp8_wgmma_decode_min_n and n % 16 == 0 and k % 16 == 0


def runs(x8: torch.Tensor, w8: torch.Tensor) -> bool:
    """Whether fp8_gemm runs its product of codes x8 [M, K] and w8 [N, K] here: shape_fits under the Tuning in
    force, 16-byte aligned operands and a Hopper GPU."""
    if not (x8.is_cuda and x8.dim() == 2 and x8.dtype in CODES and x8.data_ptr() % 16 == 0
            and w8.data_ptr() % 16 == 0 and w8.is_contiguous()):
        return False
    M, K = x8.shape
    return shape_fits(M, w8.shape[0], K, tuning.current()) and build.has_wgmma(x8.device.index or 0)


@dataclass(frozen=True)
class DecodeLaunch:
    """grid (ceil(N / 64), splits, ceil(M / bt)), THREADS threads, smem_bytes(bt) of dynamic shared memory."""

    bt: int
    splits: int
    tiles_per_split: int

    def __post_init__(self):
        if self.bt not in STAGES:
            raise ValueError(f"fp8_wgmma_decode: token tile {self.bt} is not 32 or 64")
        if self.splits < 1 or self.tiles_per_split < 1:
            raise ValueError(f"fp8_wgmma_decode: {self.splits} splits of {self.tiles_per_split} tiles")

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return cdiv(n, CHANNELS), self.splits, cdiv(m, self.bt)

    def columns(self, m: int, n: int) -> int:
        """Blocks of one split: one counter and one workspace piece each."""
        return cdiv(n, CHANNELS) * cdiv(m, self.bt)


def plan(m: int, n: int, k: int, sms: int, splits: int | None = None,
         t: tuning.Tuning | None = None) -> DecodeLaunch:
    """The token tile and the K splits. No split where the column blocks give every SM one: a split then only adds
    the workspace's round trip (H200, q|k|v at 32 rows, 192 blocks: 17.2 us unsplit against 20.4 in 2 splits).
    Fewer columns: as many splits as fill tuning's fp8_wgmma_decode_blocks_per_sm slots a SM, at most
    fp8_wgmma_decode_max_splits, each at least fp8_wgmma_decode_min_tiles_per_split 128-k tiles. `splits` forces the
    count (tests, benchmarks). No split is left empty."""
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"fp8_wgmma_decode: empty product M={m} N={n} K={k}")
    t = tuning.current() if t is None else t
    bt = token_tile(m)
    tiles = cdiv(k, BK)
    columns = cdiv(n, CHANNELS) * cdiv(m, bt)
    if splits is None:
        splits = 1 if columns >= sms else min(t.fp8_wgmma_decode_blocks_per_sm * sms // columns,
                                              t.fp8_wgmma_decode_max_splits,
                                              tiles // t.fp8_wgmma_decode_min_tiles_per_split)
    splits = max(1, min(splits, tiles))
    tps = cdiv(tiles, splits)
    return DecodeLaunch(bt, cdiv(tiles, tps), tps)


def _key(w8: torch.Tensor) -> tuple:
    return w8.device.index, w8.data_ptr(), tuple(w8.shape)


def keep_weight_map(w8: torch.Tensor) -> torch.Tensor:
    """The TMA map of w8 e4m3 [N, K] (boxes of 128 k x 64 rows), made now (outside a graph capture) and used by every
    later launch on w8 while the caller keeps the returned uint8 [128] tensor (a map depends only on the address and
    the shape, so it stays right for any tensor there)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp8_wgmma_decode: make a weight's map before the graph capture")
    check_tensor(w8, "w8", CODES, align=16)
    check_multiple(w8.shape[1], 16, "the fp8 decode GEMM's K (TMA rows of 16-byte multiples)")
    m = _kept.get(_key(w8))
    if m is None:
        m = tensor_map.device_map(w8.view(torch.uint8), BK, CHANNELS)
        _kept[_key(w8)] = m
    return m


def _weight_map(w8: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(w8's map, early): a kept map, or one made now (cached eagerly; written by put_map under capture, the
    kernel before this one, so early = 0: no weight copy before the PDL wait)."""
    m = _kept.get(_key(w8))
    if m is not None:
        return m, 1
    return tensor_map.device_map(w8.view(torch.uint8), BK, CHANNELS), int(not torch.cuda.is_current_stream_capturing())


def launch(y: torch.Tensor, x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
           residual: torch.Tensor | None, epilogue: str, fold_out: FoldOut | None = None,
           part: torch.Tensor | None = None, splits: int | None = None) -> None:
    """The kernel on checked inputs (fp8_gemm._run's or fp8_wgmma_decode's checks), on the current stream: y fp16
    [M, N] (silu: [M, N / 2]); epilogue one of EPILOGUES."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"fp8_wgmma_decode: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    M, K = x8.shape
    N = w8.shape[0]
    if M == 0 or N == 0:
        return
    lp = plan(M, N, K, sm_count(x8.device.index), splits)
    wmap, early = _weight_map(w8)
    partial = cnt = None
    if lp.splits > 1:
        columns = lp.columns(M, N)
        partial = torch.empty(lp.splits * columns * CHANNELS * lp.bt, dtype=torch.float32,
                              device=x8.device)  # [splits * columns * 64 * bt]: each block's tile in register order
        cnt = counters.counters(COUNTER_POOL, x8.device, columns)
    fold = (None,) * 4 if fold_out is None else (fold_out.w, fold_out.xg, fold_out.part, fold_out.mx)
    fn = build.get_function("fp8_wgmma_decode.cu", f"fp8_wgmma_decode_t{lp.bt}_{epilogue}", SIGNATURE)
    fn(lp.grid(M, N), (THREADS,), y, x8, a_scale, 1 if a_scale.numel() == M else 0, wmap, w_scale, residual, *fold,
       part, partial, cnt, M, N, K, lp.tiles_per_split, early, shared=smem_bytes(lp.bt))


def fp8_wgmma_decode(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                     residual: torch.Tensor | None = None, out: torch.Tensor | None = None, swiglu: bool = False,
                     fold_out: FoldOut | None = None, part: torch.Tensor | None = None,
                     splits: int | None = None) -> torch.Tensor:
    """x8 e4m3 [M, K], a_scale fp32 [M] or [1], w8 e4m3 [N, K], w_scale fp32 [N] -> y fp16 [M, N] (+ residual;
    swiglu: w8 / w_scale interleaved by 8, y [M, N / 2]) on any M, on a Hopper GPU. fold_out (with the residual): the
    next RMSNorm's xg, sums and maxima per 8 channels (int8's format). part fp32 [M, N / 16] (swiglu): max |y| per 8
    outputs. splits forces the K splits."""
    M, K, N = _check(x8, a_scale, w8, w_scale, residual, swiglu, fold_out, part)
    with build.on_stream():
        y = out_or_new(out, (M, N // 2 if swiglu else N), torch.float16, x8, "out", align=4)  # [M, N] or [M, N/2]
        launch(y, x8, a_scale, w8, w_scale, residual, "silu" if swiglu else "res" if residual is not None else "plain",
               fold_out, part, splits)
    return y


def fp8_wgmma_decode_ref(x8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                         residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """The kernel's contract, fp8_contract's references: y [M, N] (+ residual), or with swiglu [M, N / 2]."""
    if swiglu:
        return fp8_swiglu_ref(x8, a_scale, w8, w_scale)
    return fp8_gemm_ref(x8, a_scale, w8, w_scale, residual)


def _check(x8, a_scale, w8, w_scale, residual, swiglu, fold_out, part) -> tuple[int, int, int]:
    """Shapes, dtypes, alignment and the GPU; M, K, N."""
    if x8.dim() != 2 or w8.dim() != 2:
        raise ValueError(f"x8 and w8 must be 2-D, got {tuple(x8.shape)} and {tuple(w8.shape)}")
    check_multiple(w8.shape[0], 16, "the fp8 decode GEMM's N (16-channel panels)")
    M, K, N = check_weight(x8, w8, w_scale, residual)  # K in 16-byte rows (TMA), w8 16-byte aligned (its base)
    check_tensor(x8, "x8", CODES, align=16)  # the 16-byte cp.async chunks
    check_act_scale(a_scale, M)
    if swiglu and residual is not None:
        raise ValueError("the SwiGLU epilogue takes no residual")
    if fold_out is not None:
        if residual is None:
            raise ValueError("the decode GEMM defers the next RMSNorm with its residual")
        norm_fold.check_out(fold_out, M, N, int8=True)
    if part is not None:
        if not swiglu:
            raise ValueError("part (maxima per 8 outputs) comes with the SwiGLU epilogue")
        check_tensor(part, "part", torch.float32, (M, N // 16), align=4)
    if not build.has_wgmma(x8.device.index or 0):
        raise ValueError("fp8_wgmma_decode needs an sm_90 GPU (wgmma e4m3)")
    return M, K, N
