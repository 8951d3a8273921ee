"""AWQ int4 linears on the engine's GEMV layout (awq_gemv.cu): repacked once at load from AutoAWQ's tensors.

    AutoAWQ GEMM: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]   (calibrate/awq_pack.py)
    here:         packed int32 [N/16, T, 2, 32, 4]  (T = ceil(K / 128) tiles of 128 k, zero-padded)
                  terms  int32 [N/16, T * 128 / GS, 8, 2]  (fp16 s | fp16 1024 + z << 16 per channel and
                                                            GS-group, GS = gcd(G, 128): 32, 64 or 128)

M <= GEMV_MAX_M: awq_gemv (y = sum_groups s * sum_k (q - z) x, fp32), or from BATCH_MIN_M tokens on the
awq_batch.cu GEMM (4 panels per block sharing the activations through shared memory), from WGMMA_DECODE_MIN_M
on Hopper with groups of 128 awq_wgmma_decode.cu (the same on wgmma); larger M on Hopper
with groups of 128: awq_wgmma.cu, the fused GEMM (as fast as cuBLAS fp16); otherwise w_hat [N, K] =
fp16((q - z) * s) written by awq_packed_dequant, then cuBLAS. With `swiglu` the gate|up weight's channels are
interleaved by 8 per panel of 16 and the GEMV writes silu(gate) * up directly (one kernel instead of two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from calibrate.awq_pack import unpack_awq
from kernels_cu import awq_batch, awq_wgmma, awq_wgmma_decode, build, norm_fold
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.gemm_shapes import AWQ_WIDEST_TILE, cdiv, sm_count, token_tile
from kernels_cu.fp16_gemv import fp16_linear, fp16_swiglu
from kernels_cu.norm_fold import FoldIn, FoldOut
from kernels_cu.swiglu_layout import gate_up_order, swiglu_interleaved

TILE_K = 128
PANEL = 16
GEMV_MAX_M = 64  # above: dequantize + cuBLAS (one weight read per 32 tokens costs more than a dequant pass)
BATCH_MIN_M = 17  # from here awq_batch.cu (its panels share the activations) instead of the GEMV
# From WGMMA_DECODE_MIN_M rows on Hopper with groups of 128: awq_wgmma_decode.cu (wgmma n32 / n64, each panel's
# fragments converted once for all the tokens) instead of awq_batch.cu. H100, the four LLaMA-2-7B GEMMs of a layer:
# 109 against 126 us at 32 tokens, 174 against 217 at 64; at 17 tokens 103 against 99 (awq_batch kept there).
WGMMA_DECODE_MIN_M = 32
# Above GEMV_MAX_M on Hopper with groups of 128: the fused prefill GEMM (awq_wgmma.cu) instead of w_hat + cuBLAS.
# H200, LLaMA-2-7B, 2048-token prefill: awq 39,309 -> 43,152 / 42,910 tok/s (fp16 42,432 / 42,438 in the same runs).
FUSED_PREFILL = True
THREADS = 128
# Warps per panel at up to 8 tokens with groups of 128 (gemv_warps): the widest block whose grid is one wave at
# the same 16 warps per SM, else 8 up to WIDE_WAVES waves of 4-warp blocks, else 4. 8 warps (the *_w8 entries,
# two blocks a SM) where the panels fit one wave of them (LLaMA-2-7B's o_proj / down_proj: 256 panels on 132 SMs,
# which at 4 warps left every SM with about two blocks, half its warp slots; eleventh session, engine A/B on an
# H200: +2.8 / +2.1 / +1.2% at batch 1 / 4 / 8).
# 2 warps (*_w2, eight a SM) where the panels fit one wave of those and fill most of it (q|k|v, 768: 11.6 warps a
# SM; each warp streams 16 tiles).
# Twenty-eighth session, engine A/B of q|k|v, decode tok/s against 8 warps (the rule before, WIDE_WAVES): H200
# +2.8 / +3.1 / +0.4 / +0.7 / +2.0% at batch 1 / 2 / 3 / 4 / 8 (against 4 warps +1.7 / +2.6% at 1 / 2), H100
# +1.5 / +1.2 / +2.1% at 1 / 2 / 8. The H100 timeline: q|k|v itself is 0.6 us a layer slower, attention 1.3 us
# faster; with 5.8 of its 8 blocks a SM the grid leaves registers for an attention block, whose first K/V stage
# then streams under q|k|v (docs/gpu.md step 28). gate|up (1376 panels) stays on 4: on 2 warps (1.3 waves)
# -3.7% at batch 1 (H200), on 1 (one wave of 1-warp blocks, 10.4 warps a SM) -3.9% (H100; +2.5% at batch 8), on
# 8 -5.6% (each block's reduction and epilogue paid twice as often). A fuller wave is needed: LLaMA-2-70B's o_proj
# / down_proj (512 panels, 7.8 warps a SM) on 2 warps cost -6.0% at batch 1 and its q|k|v (640, 9.7 warps) -1.1%
# (H100, engine A/B of TWO_WARP_MIN_WARPS): they stay on 8.
TWO_WARPS = True
TWO_WARP_MIN_WARPS = 11  # ... where that one wave holds at least this many warps a SM
# 1 warp (*_w1, sixteen a SM) at ONE_WARP_MIN_ROWS rows where the panels are too many for a wave of 2-warp blocks
# and fit one of 1-warp blocks (gate|up, 1376: 10.4 warps a SM, each streaming all 32 tiles of its panel, with no
# cross-warp reduction). Twenty-ninth session, engine A/B on the H100 (awq decode tok/s against 4 warps): ONE_WARP
# +2.5% at batch 8 (2,776 -> 2,846), batch 1 unchanged; 1 warp at fewer rows (ONE_WARP_MIN_ROWS 4 / 2) -4.1% at 4
# rows, -2.4% at 2, and -3.9% at one (twenty-eighth session).
ONE_WARP = True
ONE_WARP_MIN_ROWS = 8
WIDE_WAVES = 1.5  # 8 warps up to this many waves of 4-warp blocks (70B's o, down, q|k|v; all, with TWO_WARPS off)
# y, x, packed, terms, residual, M, N, K, tiles, fold_w, fold_xg, fold_part, fold_in, eps
SIGNATURE = "PPPPPiiiiPPPPf"
# Position r (0..7) of a word's eight values (mma 2w: r 0-3, mma 2w + 1: r 4-7) lives in nibble NIBBLE_OF[r].
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class AwqPacked:
    """One AWQ linear (or a fused q|k|v or gate|up) in the GEMV layout."""

    packed: torch.Tensor  # int32 [N/16, T, 256]
    terms: torch.Tensor  # int32 [N/16, T * GPT, 8, 2]
    n: int  # output channels of the weight (2F for a swiglu gate|up)
    k: int
    group_size: int  # the checkpoint's G
    gs: int  # the kernel's group run: gcd(G, 128)
    swiglu: bool = False  # channels interleaved by 8: the op outputs silu(gate) * up, [M, n / 2]

    @property
    def tiles(self) -> int:
        return cdiv(self.k, TILE_K)

    @property
    def gpt(self) -> int:
        return TILE_K // self.gs

    @property
    def out_features(self) -> int:
        return self.n // 2 if self.swiglu else self.n

    def nbytes(self) -> int:
        return self.packed.numel() * 4 + self.terms.numel() * 4

    def epilogue(self, residual: torch.Tensor | None) -> str:
        """The entry-name suffix of the AWQ kernels (awq_gemv, awq_batch, awq_wgmma) for this op and call."""
        return "silu" if self.swiglu else "res" if residual is not None else "plain"


def gemv_takes(k: int, n: int, group_size: int) -> bool:
    """Panels of 16 channels, 16-byte activation runs (K % 8) and group runs of at least 32 k."""
    return n % PANEL == 0 and k % 8 == 0 and group_size % 32 == 0 and k % group_size == 0


def _k_order(gs: int) -> torch.Tensor:
    """[4 (t), 32 (position p)] -> k offset inside a tile: group q = p // (gs/4), run of lane t."""
    run = gs // 4
    p = torch.arange(32)
    t = torch.arange(4)[:, None]
    return (p // run) * gs + t * run + p % run  # [4, 32]


def pack_for_gemv(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  swiglu: bool = False) -> AwqPacked:
    """AutoAWQ GEMM tensors -> AwqPacked on their device. `swiglu`: the weight is gate|up (N = 2F) and
    its channels are interleaved by 8 so that each panel holds 8 gate channels and the same 8 up channels."""
    K = qweight.shape[0]
    N = scales.shape[1]
    G = K // scales.shape[0]
    if not gemv_takes(K, N, G):
        raise ValueError(f"the AWQ GEMV layout needs N % 16, K % 8 and G % 32 == 0 (K={K}, N={N}, G={G})")
    q = unpack_awq(qweight).t()  # [N, K] uint8
    z = unpack_awq(qzeros).t()  # [N, K/G]
    s = scales.to(torch.float16).t()  # [N, K/G]
    if swiglu:
        order = gate_up_order(N, q.device)  # [N]
        q, z, s = q[order], z[order], s[order]
    T = cdiv(K, TILE_K)
    gs = math.gcd(G, TILE_K)
    gpt = TILE_K // gs
    # weights: [N, T*128] -> lane view [N/16, T, 2 (h), 8 (g), 4 (t), 32 (p)] -> words
    qp = torch.zeros(N, T * TILE_K, dtype=torch.uint8, device=q.device)
    qp[:, :K] = q
    qp = qp.reshape(N // PANEL, 2, 8, T, TILE_K)[..., _k_order(gs).to(q.device)]  # [N/16, 2, 8, T, 4, 32]
    qp = qp.permute(0, 3, 1, 2, 4, 5).reshape(N // PANEL, T, 2, 32, 4, 8)  # [.., h, lane, word, r]
    words = torch.zeros(qp.shape[:-1], dtype=torch.int64, device=q.device)
    for r, nib in enumerate(NIBBLE_OF):
        words |= qp[..., r].to(torch.int64) << (4 * nib)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 as the int32 sign
    packed = words.reshape(N // PANEL, T, 256).contiguous()
    # terms per GS-run (a checkpoint group covers G / gs runs; runs past K get s = 0, z = 0)
    runs = T * gpt
    src = torch.arange(runs, device=q.device) * gs // G  # checkpoint group of each run
    valid = (torch.arange(runs, device=q.device) * gs) < K
    src = torch.where(valid, src, torch.zeros_like(src))
    s_bits = s[:, src].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [N, runs]
    zm = (z[:, src].to(torch.float16) + 1024).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    # 1024 + z <= 1039 is 0x640f in fp16: bit 31 stays clear, so the word is a non-negative int32 as it is
    term = torch.where(valid, s_bits | (zm << 16), torch.full_like(s_bits, 0x6400 << 16))  # pad: s 0, z 0
    terms = term.reshape(N // PANEL, 2, 8, runs).permute(0, 3, 2, 1).contiguous()  # [N/16, runs, 8 (g), 2 (h)]
    return AwqPacked(packed, terms, N, K, G, gs, swiglu)


def unpack_from_gemv(p: AwqPacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_for_gemv, read the way the kernel reads (for tests): codes [N, K] uint8,
    zeros [N, K/G] uint8 and scales [N, K/G] fp16 in the packed channel order (interleaved for swiglu)."""
    N, K, T, gs = p.n, p.k, p.tiles, p.gs
    words = p.packed.reshape(N // PANEL, T, 2, 8, 4, 4).to(torch.int64) & 0xFFFFFFFF  # [.., h, g, t, word]
    q = torch.stack([(words >> (4 * nib)) & 15 for nib in NIBBLE_OF], dim=-1)  # [.., h, g, t, word, r]
    q = q.reshape(N // PANEL, T, 2, 8, 4, 32)  # position p = 8 word + r
    out = torch.zeros(N // PANEL, 2, 8, T, TILE_K, dtype=torch.int64, device=q.device)
    out[..., _k_order(gs).to(q.device)] = q.permute(0, 2, 3, 1, 4, 5)
    codes = out.reshape(N, T * TILE_K)[:, :K].to(torch.uint8)
    terms = p.terms.to(torch.int64).permute(0, 3, 2, 1).reshape(N, -1) & 0xFFFFFFFF  # [N, runs]
    per_group = p.group_size // gs
    first = terms[:, ::per_group][:, :K // p.group_size]  # [N, K/G]
    scales = (first & 0xFFFF).to(torch.int16).view(torch.float16)
    zeros = (((first >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float() - 1024).to(torch.uint8)
    return codes, zeros, scales


def awq_linear(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
               fold_out: FoldOut | None = None) -> torch.Tensor:
    """x fp16 [M, K] -> y fp16 [M, out_features]: the GEMV kernel up to GEMV_MAX_M rows (the batch GEMM from
    BATCH_MIN_M where N % 64 == 0, its wgmma form from WGMMA_DECODE_MIN_M on Hopper with groups of 128), else
    the fused GEMM (awq_wgmma.py) where it runs, or w_hat + cuBLAS.
    fold_in / fold_out: the deferred RMSNorm (norm_fold.py), on the GEMV path only (`folds`)."""
    M = _check(x, p, residual)
    if fold_in is not None or fold_out is not None:
        if not folds(p, M):
            raise ValueError(f"the deferred RMSNorm runs on the AWQ GEMV only (M < {BATCH_MIN_M}; with groups of "
                             f"32 k, M <= 8), got M = {M}, groups of {p.gs}")
        return _gemv(x, p, residual, out, fold_in, fold_out)
    if WGMMA_DECODE_MIN_M <= M <= GEMV_MAX_M and awq_wgmma_decode.takes(x, p):
        return awq_wgmma_decode.launch(x, p, residual, out)
    if BATCH_MIN_M <= M <= GEMV_MAX_M and awq_batch.takes(p.n):
        return awq_batch.launch(x, p, residual, out)
    if M <= GEMV_MAX_M:
        return _gemv(x, p, residual, out)
    if FUSED_PREFILL and awq_wgmma.takes(x, p):
        return awq_wgmma.launch(x, p, residual, out)
    # Elsewhere: w_hat, then fp16's cuBLAS path (residual in cuBLAS's epilogue, in place when out is the
    # residual; SwiGLU of the interleaved product in one kernel).
    with build.on_stream():
        w_hat = awq_packed_dequantize(p)  # [N, K]
        if p.swiglu:
            return fp16_swiglu(x, w_hat, out)  # [M, N/2]
        return fp16_linear(x, w_hat, residual, out)  # [M, N]


def awq_gemv(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, fold_in: FoldIn | None = None,
             fold_out: FoldOut | None = None) -> torch.Tensor:
    """The GEMV kernel for any M (it re-reads the weight once per 32 rows: meant for M <= 64)."""
    _check(x, p, residual)
    return _gemv(x, p, residual, out, fold_in, fold_out)


def folds(p: AwqPacked, m: int) -> bool:
    """Whether awq_linear of m rows takes the deferred RMSNorm: on the GEMV, in the variants that compile it."""
    return m < BATCH_MIN_M and _fold_compiled(token_tile(m, AWQ_WIDEST_TILE), p.gpt)


def _fold_compiled(mt: int, gpt: int) -> bool:
    """awq_gemv.cu's FOLD: the deferred norm where the registers allow it (MT * GPT <= 4)."""
    return mt * gpt <= 4


def awq_batch_gemm(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """The batch GEMM (awq_batch.cu) for any M; `splits` forces its K split count (tuning)."""
    _check(x, p, residual)
    if not awq_batch.takes(p.n):
        raise ValueError(f"the AWQ batch GEMM needs N % {awq_batch.CHANNELS} == 0, got N = {p.n}")
    return awq_batch.launch(x, p, residual, out, splits)


def _gemv(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None, out: torch.Tensor | None,
          fold_in: FoldIn | None = None, fold_out: FoldOut | None = None) -> torch.Tensor:
    M = x.shape[0]
    if fold_out is not None and residual is None:
        raise ValueError("a deferred-norm producer is the GEMV that adds the residual")
    norm_fold.check_out(fold_out, M, p.n)
    norm_fold.check_in(fold_in, M, p.k)
    with build.on_stream():
        y = out_or_new(out, (M, p.out_features), torch.float16, x, "out", align=2)
        if M == 0:
            return y
        mt = token_tile(M, AWQ_WIDEST_TILE)
        if not _fold_compiled(mt, p.gpt) and (fold_in is not None or fold_out is not None):
            raise ValueError(f"the AWQ GEMV variant for {M} rows and groups of {p.gs} k takes no deferred RMSNorm")
        name = f"awq_gemv_mt{mt}_g{p.gpt}_{p.epilogue(residual)}"
        warps = gemv_warps(p.n // PANEL, sm_count(x.device.index), M) if mt == 1 and p.gpt == 1 else 4
        fn = build.get_function("awq_gemv.cu", name + ("" if warps == 4 else f"_w{warps}"), SIGNATURE)
        fn(gemv_grid(M, p.n), (32 * warps,), y, x, p.packed, p.terms, residual, M, p.n, p.k,
           p.tiles, *norm_fold.out_args(fold_out), *norm_fold.in_args(fold_in))
    return y


def gemv_warps(panels: int, sms: int, rows: int = 1) -> int:
    """Warps per panel (8, 2, 1 or 4) of a GEMV of `rows` <= 8 rows (groups of 128) over `panels` 16-channel panels
    on a GPU of `sms` SMs: the widest block whose grid is one wave of 16 warps a SM, 2-warp blocks only where that
    wave holds TWO_WARP_MIN_WARPS warps a SM (TWO_WARPS), 1-warp blocks only from ONE_WARP_MIN_ROWS rows (ONE_WARP;
    WIDE_WAVES for the rest)."""
    if panels <= 2 * sms:
        return 8
    if TWO_WARPS and panels <= 8 * sms and 2 * panels >= TWO_WARP_MIN_WARPS * sms:
        return 2
    if ONE_WARP and rows >= ONE_WARP_MIN_ROWS and 8 * sms < panels <= 16 * sms:
        return 1
    return 8 if panels <= WIDE_WAVES * 4 * sms else 4


def gemv_grid(m: int, n: int) -> tuple[int, int]:
    """One block per 16-channel panel and 8 * MT tokens."""
    return n // PANEL, cdiv(m, 8 * token_tile(m, AWQ_WIDEST_TILE))


def awq_packed_dequantize(p: AwqPacked, out: torch.Tensor | None = None) -> torch.Tensor:
    """w_hat fp16 [N, K] = fp16((q - z) * s), bit for bit calibrate.awq_pack.dequantize_awq (channel order
    of the packed weight)."""
    with build.on_stream():
        w_hat = out_or_new(out, (p.n, p.k), torch.float16, p.packed, "out")
        chunks = p.n * p.tiles * 16  # one thread per 16 bytes of w_hat (a tile of a channel is 256 bytes)
        fn = build.get_function("awq_gemv.cu", f"awq_packed_dequant_g{p.gpt}", "PPPiii")
        fn((cdiv(chunks, 256),), (256,), w_hat, p.packed, p.terms, p.n, p.k, p.tiles)
    return w_hat


def awq_linear_ref(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 product with w_hat (from the unpacked codes), rounded once to fp16; then residual or SwiGLU."""
    codes, zeros, scales = unpack_from_gemv(p)
    G = p.group_size
    w_hat = ((codes.double() - zeros.double().repeat_interleave(G, 1)) *
             scales.double().repeat_interleave(G, 1)).to(torch.float16)  # [N, K]
    y = (x.double() @ w_hat.double().t()).to(torch.float16)  # [M, N]
    if p.swiglu:
        return swiglu_interleaved(y)
    return y if residual is None else y + residual


def _check(x: torch.Tensor, p: AwqPacked, residual: torch.Tensor | None) -> int:
    if x.dim() != 2 or x.shape[1] != p.k:
        raise ValueError(f"x must be [M, {p.k}], got {tuple(x.shape)}")
    check_tensor(x, "x", torch.float16)
    check_tensor(p.packed, "packed", torch.int32)
    check_tensor(p.terms, "terms", torch.int32)
    if residual is not None:
        if p.swiglu:
            raise ValueError("a SwiGLU gate|up op takes no residual")
        check_tensor(residual, "residual", torch.float16, (x.shape[0], p.n), align=2)
    return x.shape[0]
