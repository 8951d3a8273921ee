"""Prefill attention of one row over the KV cache, through torch's scaled_dot_product_attention.

The S new queries of row `row` sit at positions [start, start + S) and the cache already holds their keys
and values (RoPE + cache write ran first), so query i attends to cache positions [0, start + i]. start = 0
is plain causal attention (SDPA's flash kernel); start > 0 (a continued chat) is causal with the diagonal
shifted right by `start`, given to SDPA as a lower-right causal bias. Query heads share KV heads in groups
of H / Hkv (GQA), expanded with repeat_interleave.

SDPA may choose among its flash, memory-efficient and math kernels, not cuDNN's: torch builds a cuDNN attention
graph for every new sequence length (~41 ms on an H200, torch 2.11, 760 ms for the first), so a prompt of a length
not seen before would wait for it; flash takes 0.1 ms there and is no slower at that length.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels_cu import build
from kernels_cu.attention_decode import dequantize_cache

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # no per-shape build


def attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row: int, start: int,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q fp16 [S, H, D] -> out fp16 [S, H, D]; 8-bit caches (int8 or e4m3 codes with scales) are dequantized to
    fp16 first (code * scale in fp32, one rounding: the values the decode kernels' V products use)."""
    S, H, D = _check(q, k_cache, row, start)
    T = start + S
    # On the GPU torch runs on fllama's stream (graph capture, ordering with the kernels); the CPU path
    # exists so the masking logic is testable anywhere.
    with (build.on_stream() if q.is_cuda else contextlib.nullcontext()), sdpa_kernel(BACKENDS):
        k = _cache_slice(k_cache, k_scale, row, T, H).unsqueeze(0)  # [1, H, T, D]
        v = _cache_slice(v_cache, v_scale, row, T, H).unsqueeze(0)  # [1, H, T, D]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
        if start == 0:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True)  # [1, H, S, D]
        else:
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=_shifted_causal(S, T, q.device))
        return o[0].transpose(0, 1).contiguous()  # [S, H, D]


def attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row: int, start: int,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 with an explicit boolean mask; returns fp16 [S, H, D]."""
    S, H, D = q.shape
    T = start + S
    Hkv = k_cache.shape[1]
    k = dequantize_cache(k_cache[row, :, :T], None if k_scale is None else k_scale[row, :, :T])  # [Hkv, T, D]
    v = dequantize_cache(v_cache[row, :, :T], None if v_scale is None else v_scale[row, :, :T])  # [Hkv, T, D]
    k = k.repeat_interleave(H // Hkv, dim=0)  # [H, T, D]
    v = v.repeat_interleave(H // Hkv, dim=0)  # [H, T, D]
    s = torch.einsum("shd,htd->hst", q.float(), k) / math.sqrt(D)  # [H, S, T]
    pos = torch.arange(T, device=q.device)
    allowed = pos[None, :] <= (start + torch.arange(S, device=q.device))[:, None]  # [S, T]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hst,htd->shd", torch.softmax(s, dim=-1), v).to(torch.float16)  # [S, H, D]


def _cache_slice(cache: torch.Tensor, scale: torch.Tensor | None, row: int, T: int, H: int) -> torch.Tensor:
    kv = cache[row, :, :T]  # [Hkv, T, D]
    if scale is not None:
        kv = dequantize_cache(kv, scale[row, :, :T]).to(torch.float16)
    if kv.shape[0] == H:  # no GQA: SDPA reads the cache slice in place (a copy cost ~22 us per layer at 2048)
        return kv
    return kv.repeat_interleave(H // kv.shape[0], dim=0)  # [H, T, D]


def _shifted_causal(S: int, T: int, device: torch.device):
    try:
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(S, T)  # keeps SDPA on its fused kernels
    except ImportError:  # older torch: an explicit mask (query i sees keys <= T - S + i)
        return torch.ones(S, T, dtype=torch.bool, device=device).tril(diagonal=T - S)


def _check(q, k_cache, row: int, start: int) -> tuple[int, int, int]:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [S, H, D] and the cache [B, Hkv, L, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    S, H, D = q.shape
    B, Hkv, L, Dk = k_cache.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    if not 0 <= row < B or start < 0 or start + S > L:
        raise ValueError(f"row {row}, positions [{start}, {start + S}) do not fit the cache {tuple(k_cache.shape)}")
    if q.dtype != torch.float16:
        raise ValueError(f"q must be fp16, got {q.dtype}")
    return S, H, D
