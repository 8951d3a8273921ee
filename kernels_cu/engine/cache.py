"""The KV cache of one decode bucket, and what it costs in bytes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kernels_cu import build
from kernels_cu.kv_codes import KvKind, require_kind
from model_zoo.config import LlamaConfig
from model_zoo.errors import DeviceError


@dataclass
class GpuCache:
    """A KV cache for one batch bucket. `lengths` is the device tensor the decode graph reads; storage has
    one spare position per row so a row that is not decoding this step can write past its end harmlessly."""

    k: list[torch.Tensor]  # per layer [Bb, n_kv, cap + 1, d] fp16, or int8 / e4m3 codes (EngineConfig.kv)
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [Bb] int32
    max_len: int  # positions a row may hold (<= cap)
    batch: int  # rows the caller asked for (<= Bb)
    k_scale: list = field(default_factory=list)  # 8-bit codes: per layer [Bb, n_kv, cap + 1] fp32 (x = code * scale)
    v_scale: list = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # "logits" | "sampled" -> (CUDA graph, its output tensor)
    # prefill graphs: (rows, length, starts) -> (graph, its ids input, its logits, the other inputs it reads),
    # least recently used first
    prefill_graphs: OrderedDict = field(default_factory=OrderedDict)
    prefill_seen: set = field(default_factory=set)  # prefill shapes run once, eagerly
    static: dict = field(default_factory=dict)  # buffers the decode graphs use: tokens, active, row, lens, row_amax
    views: dict = field(default_factory=dict)  # m -> rows 0..m-1 as a cache of their own (engine/pipe.py)

    @property
    def bucket(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] - 1

    def scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.k_scale[i], self.v_scale[i]) if self.k_scale else (None, None)

    def step_buffers(self) -> dict:
        """The decode graphs' device inputs, made on first use (a graph holds their addresses)."""
        if not self.static:
            dev, B = self.lengths.device, self.bucket
            self.static = {"tokens": torch.zeros(B, dtype=torch.int32, device=dev),
                           "active": torch.zeros(B, dtype=torch.int32, device=dev),
                           "row": torch.arange(B, dtype=torch.int32, device=dev),
                           # attention's lengths (lengths + 1), written by the step's embedding kernel
                           "lens": torch.zeros(B, dtype=torch.int32, device=dev),
                           # the int8 SwiGLU GEMV's row maxima (tuning.swiglu_row_amax)
                           "row_amax": torch.zeros(B, dtype=torch.float32, device=dev)}
        return self.static


def kv_position_bytes(config: LlamaConfig, kind: KvKind) -> int:
    """Bytes of one position of one row's K and V over all layers and KV heads (8-bit codes + an fp32 scale)."""
    return 2 * config.n_layers * config.n_kv_heads * KvKind(kind).head_bytes(config.head_dim)


def alloc_cache(config: LlamaConfig, kind: KvKind, bucket: int, cap: int, device: torch.device) -> GpuCache:
    """An empty cache of `bucket` rows and `cap` positions, checked against the GPU's free memory first."""
    kind = KvKind(kind)
    require_kind(kind, device.index if device.index is not None else torch.cuda.current_device())
    shape = (bucket, config.n_kv_heads, cap + 1, config.head_dim)
    need = bucket * (cap + 1) * kv_position_bytes(config, kind)
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        raise DeviceError(f"the KV cache for batch {bucket} x {cap} positions needs {need / 2**30:.1f} GiB but "
                          f"{free / 2**30:.1f} GiB are free: lower the batch or the context")
    dtype = kind.dtype
    L = config.n_layers
    with build.on_stream():
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(L)]
        scales = ([[torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(L)] for _ in range(2)]
                  if kind.scaled else [[], []])
        lengths = torch.zeros(bucket, dtype=torch.int32, device=device)
    return GpuCache(k=k, v=v, lengths=lengths, max_len=cap, batch=bucket, k_scale=scales[0], v_scale=scales[1])
