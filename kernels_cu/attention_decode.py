"""Decode attention over the KV cache (attention_fused.cu; attention_decode.cu), flash-decoding style, and its
torch reference.

    q [B, H, D] fp16 (rotated), k_cache / v_cache [B, Hkv, L, D] fp16 -- or int8 / float8_e4m3fn codes with
    k_scale / v_scale fp32 [B, Hkv, L] (value = code * scale; kv_codes.py) -- lengths int32 [B] on the device
    (valid positions, the new token included). out[b, h] = softmax(q . K^T / sqrt(D)) V over positions
    [0, lengths[b]).

Two launch paths (D is 64 or 128):
- fused (default): one kernel. Each (row, kv head, head group) unit's context is split evenly at run time
  over up to S blocks (S fixed by the batch, heads and SM count, so one CUDA graph serves every step);
  the last block of a unit to finish combines the partials, found with a per-unit counter that the
  kernel puts back to zero itself. `attention_decode_quant` also quantizes the output per token to int8
  (the quantize.py rule over each row's H * D values) in the same launch.
  Where a unit has 2 or more blocks (small batches: LLaMA-2-7B at batch 1 has 12; with GQA a wave's worth is
  capped at 16) and the GPU has thread-block clusters (sm_90), each unit's blocks run as one cluster and combine through distributed shared memory
  instead (the `_cl` entries: no workspace, fence or counter; the same bits).
- fused=False: the two-kernel flash-decoding path (chunks of up to 512 positions, then a combine).

RoPE mode (`attention_decode_rope`, `attention_decode_rope_quant`): the fused kernel also does rope_kv's
work for the new token, so a decode step needs no rope_kv launch. It takes the fused QKV output qkv fp16
[B, (H + 2 Hkv) D] (q heads, k heads, v heads) and rope_table()'s cos_sin fp32 [max_pos, D]; row b's new
token is cache row b at position p = lengths[b] - 1. The kernel rotates q itself and writes rotated k and v
into the caches at (b, :, p) before attending over [0, lengths[b]), all bit for bit as rope_kv (pos = p,
row = b) followed by attention_decode: p outside the table -> q = 0 and no write; p >= L or lengths[b] = 0
-> no write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels_cu import build, counters, tuning
from kernels_cu.checks import check_static_amax, check_tensor, out_or_new
from kernels_cu.gemm_shapes import ATTN_CHUNKS, attn_chunk, cdiv, sm_count, smem_per_sm
from kernels_cu.kv_codes import SUFFIX, KvKind, require_kind

HEAD_DIMS = (64, 128)
SLOTS = 8  # query heads per block

# fused kernel geometry: mirrors fllama::fused::Geom in attention_stage.cuh (the kernel traps on a mismatch)
FUSED_WARPS = 4
FUSED_THREADS = 32 * FUSED_WARPS
FUSED_STAGE = 16 * FUSED_WARPS  # positions per pipeline stage
FUSED_NBUF = 2  # stages resident in shared memory
FUSED_PH_STRIDE = 24  # halves per head row of a warp's P tile
MAX_SPLITS = 512
CLUSTER_MAX = 16  # blocks per cluster of the `_cl` entries (attention_fused.cu; non-portable above 8)
COUNTER_POOL = "attention"
SIGNATURE = "PPPPPPPPPPPPPPPPiiiiiif"  # the attn_fused_* entries
FUSED_STATIC_SMEM = 1104  # bytes of static shared memory (ptxas; the most is the `_cl` entries' push table)
BLOCK_RESERVED_SMEM = 1024  # shared memory the hardware reserves per resident block (sm_80 and later)
MAX_BLOCKS_PER_SM = 4  # the register budget (<= 128 per thread except d128 fp16, which smem caps at 3)


@dataclass(frozen=True)
class FusedLaunch:
    """Grid and shared memory of one fused launch: grid (splits, units), FUSED_THREADS threads."""
    splits: int  # S: blocks per unit; a row's tiles are spread over the first n <= S of them
    span_tiles: int  # 0: tiles per block = ceil(tiles / S) at run time; else fixed (the `chunk` option)
    units: int  # B * Hkv * head groups
    smem: int  # dynamic shared memory bytes
    cluster: bool = False  # each unit's S blocks one thread-block cluster (the `_cl` entry)

    def __post_init__(self):
        if not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {self.splits}")
        if self.span_tiles < 0 or self.units < 0 or self.smem <= 0 or (self.cluster and self.splits > CLUSTER_MAX):
            raise ValueError(f"bad fused launch {self}")


def fused_smem_bytes(D: int, kv8: bool) -> int:
    """Dynamic shared memory of attn_fused_d{D}[_kv8]: NBUF stages of [K | V | scales] + the P tiles."""
    row = (D if kv8 else 2 * D) + 16  # one position, padded by 16 bytes against bank conflicts
    buf = 2 * FUSED_STAGE * row + (2 * FUSED_STAGE * 4 if kv8 else 0)
    return FUSED_NBUF * buf + FUSED_WARPS * SLOTS * FUSED_PH_STRIDE * 2


def fused_blocks_per_sm(D: int, kv8: bool, smem_per_sm: int) -> int:
    per_block = fused_smem_bytes(D, kv8) + FUSED_STATIC_SMEM + BLOCK_RESERVED_SMEM
    return max(1, min(MAX_BLOCKS_PER_SM, smem_per_sm // per_block))


def fused_launch(L: int, B: int, Hkv: int, groups: int, D: int, kv8: bool, sms: int, smem_per_sm: int,
                 chunk: int | None = None, splits: int | None = None,
                 max_clusters: Callable[[int], int] | None = None) -> FusedLaunch:
    """Splits per unit: enough blocks for one full wave (blocks per SM x SMs) when the rows are long.

    Depends on the cache shape, batch and device only (never on the lengths), so one graph serves every
    step. `chunk` instead fixes the positions per block (a multiple of 16) and S = ceil(L / chunk);
    `splits` forces S (tuning).

    max_clusters(S) -> how many clusters of S blocks the GPU holds at once (None: no clusters). A launch of
    more than one split becomes one cluster per unit, with S lowered to at most CLUSTER_MAX and to the largest
    that keeps every cluster in one wave (a cluster that does not fit waits for a whole one to finish: 8.6 -> 11.9 us for LLaMA-2-7B
    batch 1 at S = 12, where 30 of its 32 clusters fit; at S = 10, 7.8 us, H200). A fixed chunk or forced
    `splits` keeps its S (and a cluster only where that S fits).
    """
    units = B * Hkv * groups
    smem = fused_smem_bytes(D, kv8)
    span, forced = 0, splits is not None
    if chunk is not None:
        if chunk % 16 or chunk < 16:
            raise ValueError(f"chunk must be a positive multiple of 16, got {chunk}")
        splits = max(1, cdiv(L, chunk))
        if splits > MAX_SPLITS:
            raise ValueError(f"chunk {chunk} splits {L} positions into {splits} > {MAX_SPLITS} blocks")
        span = chunk // 16
    elif splits is None:
        wave = fused_blocks_per_sm(D, kv8, smem_per_sm) * sms
        splits = max(1, min(wave // max(units, 1), MAX_SPLITS, cdiv(max(L, 1), 16)))
    cluster, fixed = False, span > 0 or forced
    # A wave's worth of splits above CLUSTER_MAX (few units: GQA at small batch) still becomes clusters of at most
    # CLUSTER_MAX: combining in shared memory beats the workspace at any length (H200, batch 1, 8 units: 576
    # positions 7.9 us against 17.7 on 49 splits, 8,192 positions 20.2 against 29.8; 4 units at 4,096: 10.9 / 40.3).
    if max_clusters is not None and 1 < splits and (splits <= CLUSTER_MAX or not fixed):
        tries = [splits] if fixed else range(min(splits, CLUSTER_MAX), 1, -1)
        fit = next((s for s in tries if max_clusters(s) >= units), None)
        if fit is not None:
            splits, cluster = fit, True
    return FusedLaunch(splits, span, units, smem, cluster=cluster)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, chunk: int | None = None, fused: bool = True) -> torch.Tensor:
    """-> out fp16 [B, H, D]. fused: one launch (chunk, if given, fixes the positions per block: a multiple
    of 16); fused=False: the two-kernel path (chunk: a multiple of 16 up to 512)."""
    if fused:
        out, _, _, _ = _launch_fused(q, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk, quant=False)
        return out
    B, H, D, Hkv, L = _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    groups = cdiv(H // Hkv, SLOTS)
    cs = chunk or attn_chunk(L, B, Hkv, groups, sm_count(q.device.index))
    if cs % 16 or not 16 <= cs <= ATTN_CHUNKS[0]:
        raise ValueError(f"chunk must be a multiple of 16 in [16, {ATTN_CHUNKS[0]}], got {cs}")
    C = cdiv(L, cs)
    kv8 = SUFFIX[KvKind.of(k_cache)]
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


def attention_decode_rope(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          lengths: torch.Tensor, n_heads: int, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          chunk: int | None = None) -> torch.Tensor:
    """RoPE + KV-cache write of the new token + decode attention in one launch -> out fp16 [B, H, D].

    qkv fp16 [B, (n_heads + 2 Hkv) D]: row b's new token, at position lengths[b] - 1 of cache row b.
    Equals rope_kv(qkv, cos_sin, pos=lengths - 1, row=arange(B), ...) then attention_decode on its q, bit
    for bit, caches included (k_cache / v_cache, and k_scale / v_scale for 8-bit codes, are written in place).
    """
    out, _, _, _ = _launch_fused(qkv, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk, quant=False,
                                 cos_sin=cos_sin, n_heads=n_heads)
    return out


def attention_decode_rope_quant(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, lengths: torch.Tensor, n_heads: int,
                                static_amax: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                q_out: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                                chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_decode_rope with the output quantized per token -> (q_out int8 [B, H * D], a_scale fp32 [B]),
    as attention_decode_quant quantizes it."""
    _, q_out, a_scale, _ = _launch_fused(qkv, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk,
                                         quant=True, static_amax=static_amax, q_out=q_out, a_scale=a_scale,
                                         cos_sin=cos_sin, n_heads=n_heads)
    return q_out, a_scale


def attention_decode_rope_parts(qkv: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, lengths: torch.Tensor, n_heads: int,
                                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                out: torch.Tensor | None = None, chunk: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_decode_rope for an int8 o_proj that quantizes its input itself (int8_gemm.DeferredQuant):
    -> (out fp16 [B, H * D], part fp32 [B, Hkv * ceil(H / Hkv / 8)]), part[b, u] = max |out| over unit u's
    heads of row b, so the max of part[b] is row b's amax exactly."""
    out, _, _, part = _launch_fused(qkv, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk, quant=False,
                                    cos_sin=cos_sin, n_heads=n_heads, parts=True)
    return out.reshape(out.shape[0], -1), part


def attention_decode_quant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                           static_amax: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           q_out: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                           chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention quantized per token in the same launch -> (q_out int8 [B, H * D], a_scale fp32 [B]).

    q_out equals quantize_ref(out.reshape(B, H * D), static_amax) bit for bit, where out is the fp16
    attention output (written to `out` [B, H, D] when given, else to scratch). static_amax: fp32 tensor of
    one element on the GPU (a graph keeps reading it), or None for dynamic per-row amax.
    """
    _, q_out, a_scale, _ = _launch_fused(q, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk, quant=True,
                                         static_amax=static_amax, q_out=q_out, a_scale=a_scale)
    return q_out, a_scale


def reset_counters() -> None:
    """Zero the fused kernels' counters (only needed after a launch was aborted mid-way)."""
    counters.reset(COUNTER_POOL)


def _launch_fused(q, k_cache, v_cache, lengths, k_scale, v_scale, out, chunk, quant: bool,
                  static_amax=None, q_out=None, a_scale=None, splits: int | None = None,
                  cos_sin: torch.Tensor | None = None, n_heads: int | None = None, parts: bool = False):
    """q: the rotated query [B, H, D]; with cos_sin (RoPE mode), the fused QKV output [B, (H + 2 Hkv) D].
    -> (out, q_out, a_scale, part): part [B, units / B] of each unit's max |out| with `parts` (else None)."""
    rope = cos_sin is not None
    if rope:
        B, H, D, Hkv, L = _check_rope(q, cos_sin, n_heads, k_cache, v_cache, lengths, k_scale, v_scale)
    else:
        B, H, D, Hkv, L = _check(q, k_cache, v_cache, lengths, k_scale, v_scale)
    kind = KvKind.of(k_cache)
    kv8 = kind.scaled  # the 8-bit kinds share the kernel's layout
    check_static_amax(static_amax)
    groups = cdiv(H // Hkv, SLOTS)
    if B * Hkv * groups > 65535:
        raise ValueError(f"batch {B} x {Hkv} kv heads x {groups} head groups exceeds the grid's 65535 units")
    name, units = f"attn_fused_d{D}{SUFFIX[kind]}", B * Hkv * groups
    max_clusters = None
    if tuning.current().attention_clusters and units > 0 and build.has_clusters(q.device.index or 0):
        fn_cl = build.get_function("attention_fused.cu", name + "_cl", SIGNATURE)
        smem = fused_smem_bytes(D, kv8)
        max_clusters = lambda s: fn_cl.max_active_clusters((s, units), (FUSED_THREADS,), smem, (s, 1, 1))  # noqa: E731
    launch = fused_launch(L, B, Hkv, groups, D, kv8, sm_count(q.device.index), smem_per_sm(q.device.index), chunk,
                          splits, max_clusters)
    with build.on_stream():
        # the dynamic quantization reads a row of out back with 16-byte loads
        out = out_or_new(out, (B, H, D), torch.float16, q, "out", align=16 if quant else 2)
        if quant:
            q_out = out_or_new(q_out, (B, H * D), torch.int8, q, "q_out", align=16)
            a_scale = out_or_new(a_scale, (B,), torch.float32, q, "a_scale", align=4)
        part = torch.empty((B, launch.units // max(B, 1)), dtype=torch.float32, device=q.device) if parts else None
        if B == 0:
            return out, q_out, a_scale, part
        counts = counters.counters(COUNTER_POOL, q.device, launch.units + B)
        S = launch.splits
        part_o = part_ml = None  # a cluster combines in distributed shared memory
        if not launch.cluster:
            part_o = torch.empty((B, H, S, D), dtype=torch.float32, device=q.device)  # [B, H, S, D]
            part_ml = torch.empty((B, H, S, 2), dtype=torch.float32, device=q.device)  # [B, H, S, (m, l)]
        fn = build.get_function("attention_fused.cu", name + ("_cl" if launch.cluster else ""), SIGNATURE)
        fn((S, launch.units), (FUSED_THREADS,), out, q_out if quant else None, a_scale if quant else None,
           static_amax if quant else None, part, part_o, part_ml, counts, None if rope else q, q if rope else None,
           cos_sin, k_cache, v_cache, k_scale, v_scale, lengths, H, Hkv, L, S, launch.span_tiles,
           cos_sin.shape[0] if rope else 0, math.log2(math.e) / math.sqrt(D), shared=launch.smem,
           cluster=(S, 1, 1) if launch.cluster else None)
    return out, q_out, a_scale, part


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
    """fp16 cache -> float32 as is; int8 / e4m3 codes [..., n, D] with scale [..., n] -> codes * scale in float32."""
    if scale is None:
        return codes.float()
    return codes.float() * scale.float().unsqueeze(-1)


def _check(q, k_cache, v_cache, lengths, k_scale, v_scale) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, D] and the caches [B, Hkv, L, D], got {tuple(q.shape)} "
                         f"and {tuple(k_cache.shape)}")
    B, H, D = q.shape
    _, Hkv, L, _ = k_cache.shape
    if tuple(k_cache.shape) != (B, Hkv, L, D) or H % Hkv:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    check_tensor(q, "q", torch.float16)
    _check_cache(k_cache, v_cache, lengths, k_scale, v_scale)
    return B, H, D, Hkv, L


def _check_rope(qkv, cos_sin, n_heads, k_cache, v_cache, lengths, k_scale, v_scale) -> tuple[int, int, int, int, int]:
    if k_cache.dim() != 4:
        raise ValueError(f"the caches must be [B, Hkv, L, D], got {tuple(k_cache.shape)}")
    B, Hkv, L, D = k_cache.shape
    if not isinstance(n_heads, int) or Hkv == 0 or n_heads <= 0 or n_heads % Hkv:
        raise ValueError(f"n_heads must be a positive multiple of the cache's {Hkv} kv heads, got {n_heads}")
    _check_cache(k_cache, v_cache, lengths, k_scale, v_scale)
    check_tensor(qkv, "qkv", torch.float16, (B, (n_heads + 2 * Hkv) * D))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != D or cos_sin.shape[0] == 0:  # the kernel reads row 0 regardless
        raise ValueError(f"cos_sin must be [max_pos, {D}] (rope_table), got {tuple(cos_sin.shape)}")
    check_tensor(cos_sin, "cos_sin", torch.float32)
    return B, n_heads, D, Hkv, L


def _check_cache(k_cache, v_cache, lengths, k_scale, v_scale) -> None:
    B, Hkv, L, D = k_cache.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported by the decode kernel (supported: {HEAD_DIMS})")
    kind = KvKind.of(k_cache)
    check_tensor(k_cache, "k_cache", kind.dtype, (B, Hkv, L, D))
    check_tensor(v_cache, "v_cache", k_cache.dtype, (B, Hkv, L, D))
    check_tensor(lengths, "lengths", torch.int32, (B,), align=4)
    if kind.scaled != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 or fp8 cache needs k_scale and v_scale; an fp16 cache takes none")
    require_kind(kind, k_cache.device.index or 0)
    if k_scale is not None:
        check_tensor(k_scale, "k_scale", torch.float32, (B, Hkv, L), align=4)
        check_tensor(v_scale, "v_scale", torch.float32, (B, Hkv, L), align=4)
