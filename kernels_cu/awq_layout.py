"""The AWQ GEMV layout (awq_layout.cuh): AutoAWQ's tensors repacked once at load for the engine's int4 kernels.

    AutoAWQ GEMM: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]   (model_zoo/quant/awq_pack.py)
    here:         packed int32 [N/16, T, 2, 32, 4]  (T = ceil(K / 128) tiles of 128 k, zero-padded)
                  terms  int32 [N/16, T * 128 / GS, 8, 2]  (fp16 s | fp16 1024 + z << 16 per channel and
                                                            GS-group, GS = gcd(G, 128): 32, 64 or 128)

awq_gemv.cu, awq_batch.cu, awq_wgmma.cu and awq_wgmma_decode.cu all read it. With `swiglu` the gate|up weight's
channels are interleaved by 8 per panel of 16, so one kernel writes silu(gate) * up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels_cu.gemm_shapes import cdiv
from kernels_cu.swiglu_layout import gate_up_order
from model_zoo.quant.awq_pack import unpack_awq

TILE_K = 128
PANEL = 16
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
