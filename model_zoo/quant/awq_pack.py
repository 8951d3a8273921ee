"""AWQ W4A16 in AutoAWQ's GEMM layout: round-to-nearest with zero points, nibble packing, dequantization.

Per Linear K -> N (AWQ stores the transposed weight, [K, N]):
    qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N].
Per output column n and group of G inputs: s = (max - min).clamp(1e-5) / 15, z = clamp(-rint(min / s), 0, 15),
q = clamp(rint(w / s) + z, 0, 15); dequant w_hat = (q - z) * s, taken in the activation dtype.
Nibble i (bits 4i..4i+3) of word c holds column 8c + AWQ_ORDER[i]; the interleave lets the LOP3 int4 -> fp16
conversion produce adjacent column pairs. This is not llm-awq's TinyChat packing.
"""

from __future__ import annotations

import torch

from model_zoo.errors import ConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i <- column AWQ_ORDER[i] of each group of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j <- nibble AWQ_REVERSE_ORDER[j]
PACK = 8  # int4 values per int32 word
QMAX = 15
SCALE_RANGE_MIN = 1e-5  # a constant group still gets a positive scale (AutoAWQ's clamp)
COMMON_GROUP_SIZES = (32, 64, 128, 192, 256)


def check_awq_shape(in_features: int, out_features: int, group_size: int) -> None:
    """ConfigError unless group_size divides K and N is a multiple of 8; says which group sizes would work."""
    if group_size <= 0:
        raise ConfigError(f"group size must be positive, got {group_size}")
    if in_features % group_size:
        fits = [g for g in COMMON_GROUP_SIZES if in_features % g == 0]
        hint = f"use one of {', '.join(map(str, fits))}" if fits else "none of 32/64/128/192/256 divides it"
        raise ConfigError(f"group size {group_size} does not divide the input size {in_features}; {hint}")
    if out_features % PACK:
        raise ConfigError(f"AWQ packs 8 output columns per int32: output size {out_features} is not a multiple of 8")


def awq_grid(w: torch.Tensor, group_size: int,
             clip_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> each group's grid: (step fp16 [N, K/G], zero point fp32 [N, K/G], whole numbers 0..15), from
    its range after `clip_max` [N, K/G] (AWQ's clipping search) clamps it to [-clip_max, clip_max]."""
    return _grid(_clipped_groups(w, group_size, clip_max))


def quantize_awq_rtn(w: torch.Tensor, group_size: int,
                     clip_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q uint8 [K, N] in 0..15, zeros uint8 [K/G, N], scales fp16 [K/G, N]).

    `clip_max` [N, K/G] (AWQ's clipping search) clamps each group to [-clip_max, clip_max] first.
    Codes are computed against the fp16-rounded scale that is stored, in fp32.
    """
    wg = _clipped_groups(w, group_size, clip_max)  # [N, K/G, G]
    steps, zeros = _grid(wg)  # [N, K/G] each
    q = (torch.round(wg / steps.float().unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0, QMAX)  # [N, K/G, G]
    return q.reshape(w.shape).T.to(torch.uint8).contiguous(), zeros.T.to(torch.uint8).contiguous(), steps.T.contiguous()


def _clipped_groups(w: torch.Tensor, group_size: int, clip_max: torch.Tensor | None) -> torch.Tensor:
    """W [N, K] (checked) -> its groups [N, K/G, G] in fp32, clamped to [-clip_max, clip_max] where given."""
    if w.dim() != 2:
        raise ConfigError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    check_awq_shape(k, n, group_size)
    wg = w.detach().float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    if clip_max is None:
        return wg
    c = clip_max.float().reshape(n, k // group_size, 1)  # [N, K/G, 1]
    return torch.maximum(torch.minimum(wg, c), -c)


def _grid(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups [N, K/G, G] -> (step fp16 [N, K/G], zero point fp32 [N, K/G]) spanning each group's range."""
    w_max, w_min = wg.amax(dim=2), wg.amin(dim=2)  # [N, K/G]
    steps = ((w_max - w_min).clamp(min=SCALE_RANGE_MIN) / QMAX).to(torch.float16)  # [N, K/G]
    zeros = (-torch.round(w_min / steps.float())).clamp(0, QMAX)  # [N, K/G]
    return steps, zeros


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """int4 codes [R, N] (any integer dtype, values 0..15) -> int32 [R, N/8] in AWQ's interleaved order."""
    if q.dim() != 2 or q.shape[1] % PACK:
        raise ConfigError(f"AWQ packing needs [rows, N] with N a multiple of 8, got shape {tuple(q.shape)}")
    q64 = q.to(torch.int64)
    if q64.numel() and (q64.min() < 0 or q64.max() > QMAX):
        raise ConfigError("int4 codes must lie in 0..15")
    q64 = q64.reshape(q.shape[0], -1, PACK)  # [R, N/8, 8]
    words = torch.zeros(q64.shape[:2], dtype=torch.int64, device=q.device)  # [R, N/8]
    for i, col in enumerate(AWQ_ORDER):
        words |= q64[:, :, col] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret bit 31 as the int32 sign
    return words.to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> uint8 codes [R, N] in natural column order."""
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ConfigError(f"AWQ unpacking needs int32 [rows, N/8], got {packed.dtype} {tuple(packed.shape)}")
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=packed.device)  # [8]
    # column j of each group of 8 sits in nibble AWQ_REVERSE_ORDER[j]; & 15 also drops the sign extension
    q = (packed.unsqueeze(2) >> shifts) & QMAX  # [R, N/8, 8]
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """AWQ GEMM tensors -> W_hat [N, K] in `dtype`: (q - z) exactly as an integer, times s, in `dtype`."""
    q = unpack_awq(qweight).to(torch.int16)  # [K, N]
    z = unpack_awq(qzeros).to(torch.int16)  # [K/G, N]
    k, n = q.shape
    check_awq_shape(k, n, group_size)
    if z.shape != (k // group_size, n) or scales.shape != (k // group_size, n):
        raise ConfigError(f"qzeros {tuple(z.shape)} / scales {tuple(scales.shape)} do not match "
                          f"qweight [K={k}, N={n}] with group size {group_size}")
    z = z.repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.to(dtype).repeat_interleave(group_size, dim=0)  # [K, N]
    return ((q - z).to(dtype) * s).T  # [N, K]


def fake_quantize_awq(w: torch.Tensor, group_size: int, clip_max: torch.Tensor | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """W [N, K] -> what the int4 checkpoint will compute with, [N, K] in `dtype` (default w.dtype)."""
    q, zeros, scales = quantize_awq_rtn(w, group_size, clip_max)
    dtype = dtype or w.dtype
    z = zeros.to(torch.int16).repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.to(dtype).repeat_interleave(group_size, dim=0)  # [K, N]
    return ((q.to(torch.int16) - z).to(dtype) * s).T  # [N, K]


def quantize_awq(w: torch.Tensor, group_size: int,
                 clip_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> the three AWQ GEMM tensors (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N])."""
    q, zeros, scales = quantize_awq_rtn(w, group_size, clip_max)
    return pack_awq(q), pack_awq(zeros), scales
