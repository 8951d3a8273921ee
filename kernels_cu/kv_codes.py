"""The KV cache's kinds of element (kv_codes.cuh): fp16 values, or 8-bit codes with one fp32 scale per head vector.

    fp16:  k_cache, v_cache  fp16 [B, n_kv, L, d]
    int8:  k_cache, v_cache  int8 [B, n_kv, L, d], k_scale, v_scale fp32 [B, n_kv, L]
           amax = max(max|x| over d, 1e-8); code = clamp(rint(x * (127 / amax)), +-127); scale = amax / 127
    fp8:   k_cache, v_cache  float8_e4m3fn [B, n_kv, L, d], k_scale, v_scale fp32 [B, n_kv, L]
           scale = max(max|x| over d, 1e-8) / 448; code = e4m3(x * (1 / scale)) (saturating, nearest even)

The two 8-bit kinds share the layout, the scales and every kernel's tiling; a head vector's value is code * scale.
int8 is quantize_ref's rule per head vector, fp8 model_zoo.quant.fp8's per-token rule (fp8_quantize_ref's bits),
each head vector a token. fp8 needs the e4m3 conversions of compute capability 8.9 (Ada, Hopper).
"""

from __future__ import annotations

from enum import Enum

import torch

from kernels_cu.fp8_quantize import fp8_quantize_ref, has_fp8
from kernels_cu.quantize import quantize_ref
from model_zoo.errors import DeviceError


class KvKind(str, Enum):
    """What a KV cache holds: fp16 values, or int8 / e4m3 codes with an fp32 scale per (row, head, position)."""

    FP16 = "fp16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self]

    @property
    def scaled(self) -> bool:
        """8-bit codes with a scale per head vector."""
        return self is not KvKind.FP16

    def head_bytes(self, head_dim: int) -> int:
        """Bytes of one head vector in the cache: its codes, plus the fp32 scale of the 8-bit kinds."""
        return head_dim + 4 if self.scaled else 2 * head_dim

    @classmethod
    def of(cls, cache: torch.Tensor) -> "KvKind":
        """The kind of a cache tensor, from its dtype."""
        for kind, dtype in _DTYPES.items():
            if cache.dtype == dtype:
                return kind
        raise ValueError(f"a KV cache holds fp16, int8 or float8_e4m3fn, got {cache.dtype}")


_DTYPES = {KvKind.FP16: torch.float16, KvKind.INT8: torch.int8, KvKind.FP8: torch.float8_e4m3fn}
# the kernels' entry suffixes (attention_decode.cu, attention_fused.cu; rope_kv.cu names its own)
SUFFIX = {KvKind.FP16: "", KvKind.INT8: "_kv8", KvKind.FP8: "_kvf8"}


def require_kind(kind: KvKind, device_index: int) -> None:
    """One clear line (DeviceError) when the GPU lacks what the kind needs: the e4m3 conversions for fp8."""
    if kind is KvKind.FP8 and not has_fp8(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        raise DeviceError(f"the fp8 KV cache (--kv-fp8) needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                          f"{torch.cuda.get_device_name(device_index)} is {major}.{minor}: use --kv-int8")


def quantize_kv_ref(x: torch.Tensor, kind: KvKind) -> tuple[torch.Tensor, torch.Tensor]:
    """Head vectors x [N, d] -> (codes [N, d] of kind's dtype, scale fp32 [N]): the kernels' bits."""
    if kind is KvKind.INT8:
        return quantize_ref(x)
    if kind is KvKind.FP8:
        return fp8_quantize_ref(x)
    raise ValueError(f"the {kind.value} cache holds values, not codes")
