"""RoPE fused with the KV-cache write (rope_kv.cu).

Inputs: the fused QKV output qkv fp16 [T, (n_heads + 2*n_kv) * head_dim] (q heads, then k heads, then
v heads), a table cos_sin fp32 [max_pos, head_dim] from rope_table(), and int32 pos [T] / row [T] on the
device (so one captured decode graph serves every step). Outputs: q rotated into q_out fp16
[T, n_heads, head_dim]; k rotated and v as they are into the caches at (row[t], head, pos[t]).

KV-cache layouts (what the attention kernels read; kv_codes.py):
    fp16:  k_cache, v_cache  fp16 [B, n_kv, max_len, head_dim]
    int8 / fp8:  k_cache, v_cache  int8 / float8_e4m3fn [B, n_kv, max_len, head_dim]
           k_scale, v_scale  fp32 [B, n_kv, max_len]   one scale per (row, head, position), k ~= code * scale:
           int8 quantize.quantize_ref's rule, fp8 fp8_quantize.fp8_quantize_ref's, applied per head vector.

Numerics match transformers (model_zoo.reference.apply_rope): cos/sin of fp32 frequencies cast to fp16,
q*cos + rotate_half(q)*sin in fp16. A position outside the table gives q = 0 and no cache write; a position
or row outside the cache gives no cache write.
"""

from __future__ import annotations

import torch

from kernels_cu import build, tuning
from kernels_cu.checks import check_multiple, check_tensor, out_or_new
from kernels_cu.gemm_shapes import cdiv, sm_count
from kernels_cu.kv_codes import KvKind, quantize_kv_ref, require_kind
from model_zoo import rope
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.reference import rotate_half
from model_zoo.rope import RopeScaling, RopeType

# q_out, k_cache, v_cache, k_scale, v_scale, qkv, cos_sin, pos, row, nh, nkv, d, L, B, max_pos, T, n
SIGNATURE = "PPPPPPPPPiiiiiiii"
ENTRIES = {KvKind.FP16: "rope_kv_f16", KvKind.INT8: "rope_kv_i8", KvKind.FP8: "rope_kv_f8"}
THREADS = 256  # rope_kv.cu's ROPE_THREADS
MAX_HEADS_PER_THREAD = 4  # rope_kv.cu's ROPE_MAX_HEADS


def rope_table(head_dim: int, theta: float, max_pos: int, device: torch.device | str = "cpu",
               scaling: RopeScaling | None = None) -> torch.Tensor:
    """fp32 [max_pos, head_dim]: cos then sin of pos * inv_freq, computed as transformers computes them, with the
    config's RoPE scaling (model_zoo.rope). Dynamic NTK gives its frequencies within the original context only:
    beyond it they depend on the longest row of each call, which one table cannot hold (the engine refuses it)."""
    inv_freq = rope.inv_freq(head_dim, theta, scaling, None, device)  # [d/2]
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq  # [P, d/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, d]


def rope_positions(config: LlamaConfig) -> int:
    """Positions rope_table() serves exactly: the context, or within it the original one for dynamic NTK."""
    s = config.rope_scaling
    dynamic = s is not None and s.kind is RopeType.DYNAMIC
    return min(config.max_positions, s.original_max_positions) if dynamic else config.max_positions


def _cos_sin_half(cos_sin: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin.shape[1] // 2
    rows = cos_sin[pos.long()]  # [T, d]
    cos, sin = rows[:, :half], rows[:, half:]
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)  # [T, d] each


def rope_kv_ref(qkv: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, n_heads: int, n_kv_heads: int,
                compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [T, heads, d] after RoPE. compute_dtype None: HF numerics in qkv's dtype; float64: the
    same formula without intermediate roundings (cos/sin still taken from the fp32 table)."""
    T = qkv.shape[0]
    d = cos_sin.shape[1]
    x = qkv.view(T, n_heads + 2 * n_kv_heads, d)
    q, k, v = x.split([n_heads, n_kv_heads, n_kv_heads], dim=1)  # [T, heads, d]
    dtype = compute_dtype or qkv.dtype
    cos, sin = _cos_sin_half(cos_sin, pos, dtype)
    cos, sin = cos[:, None], sin[:, None]  # [T, 1, d]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 pos: torch.Tensor, row: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Store k, v [T, n_kv, d] at (row[t], :, pos[t]); 8-bit caches get quantize_kv_ref per head vector."""
    r, p = row.long(), pos.long()
    kind = KvKind.of(k_cache)
    if kind.scaled:
        T, n_kv, d = k.shape
        for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            q, s = quantize_kv_ref(src.reshape(T * n_kv, d), kind)
            cache.view(torch.uint8)[r, :, p] = q.view(torch.uint8).view(T, n_kv, d)  # bytes: any code dtype indexes
            scale[r, :, p] = s.view(T, n_kv)
    else:
        k_cache[r, :, p] = k.to(k_cache.dtype)
        v_cache[r, :, p] = v.to(v_cache.dtype)


def rope_launch(T: int, heads: int, head_dim: int, heads_per_thread: int, sms: int) -> tuple[int, int]:
    """(n, blocks): each thread takes n of a token's `heads` (q, k and v heads), the tuning's heads_per_thread,
    or fewer where that grid would leave SMs without a block (small T: spread over SMs rather than stack loads;
    H200, d = 64 at 512 tokens: 6.0 us at 2 heads over 192 blocks against 6.3 at 4 over 96)."""
    if not 1 <= heads_per_thread <= MAX_HEADS_PER_THREAD:
        raise ValueError(f"heads_per_thread must be in [1, {MAX_HEADS_PER_THREAD}], got {heads_per_thread}")
    n = heads_per_thread
    while True:
        threads = T * cdiv(heads, n) * (head_dim // 16)
        if n == 1 or cdiv(threads, THREADS) >= sms:
            break
        n -= 1
    if threads >= 2 ** 31:
        raise ValueError(f"rope_kv: {T} tokens of {heads} heads are too many for one launch")
    return n, cdiv(threads, THREADS)


def rope_kv(qkv: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, row: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv_heads: int,
            q_out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k of every token, write k and v into the caches; returns q_out [T, n_heads, head_dim]."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [B, n_kv, max_len, head_dim], got {tuple(k_cache.shape)}")
    B, n_kv, L, d = k_cache.shape
    if n_kv != n_kv_heads:
        raise ValueError(f"k_cache has {n_kv} heads, expected n_kv_heads={n_kv_heads}")
    check_multiple(d, 16, "head_dim")
    T = qkv.shape[0]
    check_tensor(qkv, "qkv", torch.float16, (T, (n_heads + 2 * n_kv_heads) * d))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin must be [max_pos, {d}], got {tuple(cos_sin.shape)}")
    check_tensor(cos_sin, "cos_sin", torch.float32)
    check_tensor(pos, "pos", torch.int32, (T,), align=4)
    check_tensor(row, "row", torch.int32, (T,), align=4)
    kind = KvKind.of(k_cache)
    check_tensor(k_cache, "k_cache", kind.dtype, (B, n_kv, L, d))
    check_tensor(v_cache, "v_cache", kind.dtype, (B, n_kv, L, d))
    if kind.scaled:
        if (d // 16) & (d // 16 - 1) or d > 512:
            raise ConfigError(f"the {kind.value} KV cache needs head_dim in 16, 32, ..., 512, got {d}")
        require_kind(kind, k_cache.device.index or 0)
        check_tensor(k_scale, "k_scale", torch.float32, (B, n_kv, L), align=4)
        check_tensor(v_scale, "v_scale", torch.float32, (B, n_kv, L), align=4)
    q_out = out_or_new(q_out, (T, n_heads, d), torch.float16, qkv, "q_out")
    if T:
        n, blocks = rope_launch(T, n_heads + 2 * n_kv_heads, d, tuning.current().rope_heads_per_thread,
                                sm_count(qkv.device.index))
        fn = build.get_function("rope_kv.cu", ENTRIES[kind], SIGNATURE)
        fn((blocks,), (THREADS,), q_out, k_cache, v_cache, k_scale, v_scale, qkv, cos_sin, pos, row,
           n_heads, n_kv_heads, d, L, B, cos_sin.shape[0], T, n)
    return q_out
