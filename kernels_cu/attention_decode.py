"""Decode attention over the KV cache (attention_decode.cu), flash-decoding style, and its torch reference.

    q [B, H, D] fp16 (rotated), k_cache / v_cache [B, Hkv, L, D] fp16 -- or int8 with k_scale / v_scale
    fp32 [B, Hkv, L] (value = code * scale) -- lengths int32 [B] on the device (valid positions, the new
    token included). out[b, h] = softmax(q . K^T / sqrt(D)) V over positions [0, lengths[b]).

The sequence is split into chunks whose size depends only on (L, B, Hkv) and the SM count, so one CUDA
graph serves every step; blocks whose chunk starts past a row's length exit at once. D is 64 or 128.
"""

from __future__ import annotations

import math

import torch

from kernels_cu import build
from kernels_cu.checks import check_tensor, out_or_new
from kernels_cu.gemm_shapes import ATTN_CHUNKS, attn_chunk, cdiv, sm_count

HEAD_DIMS = (64, 128)
SLOTS = 8  # query heads per block


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """-> out fp16 [B, H, D]; `chunk` forces the positions per block (a multiple of 16 up to 512)."""
    B, H, D, Hkv, L = _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    groups = cdiv(H // Hkv, SLOTS)
    cs = chunk or attn_chunk(L, B, Hkv, groups, sm_count(q.device.index))
    if cs % 16 or not 16 <= cs <= ATTN_CHUNKS[0]:
        raise ValueError(f"chunk must be a multiple of 16 in [16, {ATTN_CHUNKS[0]}], got {cs}")
    C = cdiv(L, cs)
    kv8 = "_kv8" if k_cache.dtype == torch.int8 else ""
    with build.on_stream():
        out = out_or_new(out, (B, H, D), torch.float16, q, "out", align=2)
        if B == 0:
            return out
        part_o = torch.empty((B, H, C, D), dtype=torch.float32, device=q.device)  # [B, H, C, D]
        part_ml = torch.empty((B, H, C, 2), dtype=torch.float32, device=q.device)  # [B, H, C, (m, l)]
        fn = build.get_function("attention_decode.cu", f"attn_decode_d{D}{kv8}", "PPPPPPPPiiiiif")
        fn((C, B * Hkv * groups), (128,), part_o, part_ml, q, k_cache, v_cache, k_scale, v_scale, lengths,
           H, Hkv, L, cs, C, math.log2(math.e) / math.sqrt(D))
        combine = build.get_function("attention_decode.cu", "attn_decode_combine", "PPPPiiiii")
        combine((B * H,), (128,), out, part_o, part_ml, lengths, H, L, cs, C, D)
    return out


def attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32, one row at a time, explicit GQA expansion; returns fp16 [B, H, D]."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)  # [B, H, D]
    for b, n in enumerate(lengths.tolist()):
        k = dequantize_cache(k_cache[b, :, :n], None if k_scale is None else k_scale[b, :, :n])  # [Hkv, n, D]
        v = dequantize_cache(v_cache[b, :, :n], None if v_scale is None else v_scale[b, :, :n])  # [Hkv, n, D]
        k = k.repeat_interleave(H // Hkv, dim=0)  # [H, n, D]
        v = v.repeat_interleave(H // Hkv, dim=0)  # [H, n, D]
        s = torch.einsum("hd,hnd->hn", q[b].float(), k) / math.sqrt(D)  # [H, n]
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


def dequantize_cache(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp16 cache -> float32 as is; int8 codes [..., n, D] with scale [..., n] -> codes * scale in float32."""
    if scale is None:
        return codes.float()
    return codes.float() * scale.float().unsqueeze(-1)


def _check(q, k_cache, v_cache, lengths, k_scale, v_scale) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, D] and the caches [B, Hkv, L, D], got {tuple(q.shape)} "
                         f"and {tuple(k_cache.shape)}")
    B, H, D = q.shape
    _, Hkv, L, _ = k_cache.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported by the decode kernel (supported: {HEAD_DIMS})")
    if tuple(k_cache.shape) != (B, Hkv, L, D) or H % Hkv:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    check_tensor(q, "q", torch.float16)
    dtype = (torch.float16, torch.int8)
    check_tensor(k_cache, "k_cache", dtype, (B, Hkv, L, D))
    check_tensor(v_cache, "v_cache", k_cache.dtype, (B, Hkv, L, D))
    check_tensor(lengths, "lengths", torch.int32, (B,), align=4)
    if (k_cache.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 cache needs k_scale and v_scale; an fp16 cache takes none")
    if k_scale is not None:
        check_tensor(k_scale, "k_scale", torch.float32, (B, Hkv, L), align=4)
        check_tensor(v_scale, "v_scale", torch.float32, (B, Hkv, L), align=4)
    return B, H, D, Hkv, L
