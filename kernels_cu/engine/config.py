"""EngineConfig: what a user chooses about the GPU engine (the knobs of its kernels are in kernels_cu/tuning.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kernels_cu.kv_codes import KvKind
from model_zoo.errors import ConfigError, DeviceError

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode graphs are captured per bucket; a batch runs in the next one up


def bucket_of(batch: int) -> int:
    """The decode bucket a batch of `batch` rows runs in."""
    if batch > BUCKETS[-1]:
        raise DeviceError(f"batch {batch} is above the engine's largest bucket {BUCKETS[-1]}")
    return next(b for b in BUCKETS if b >= batch)


@dataclass(frozen=True)
class EngineConfig:
    max_len: int = 4096  # KV positions per row, capped at the model's context
    use_graphs: bool = True
    prefill_graphs: bool = True  # a repeated short prefill shape replays a graph (tuning.prefill_graph_tokens)
    # the KV cache: fp16, or int8 / fp8 (e4m3) codes with a scale per (row, head, position): about half the bytes
    # each decode step reads (kv_codes.py)
    kv: KvKind = KvKind.FP16
    fold_norms: bool = True  # small decode batches defer their RMSNorms into the GEMVs (engine/plan.py)
    fuse_rope: bool = True  # decode: RoPE and the new token's K/V write inside the attention kernel (no rope_kv)
    # int8 decode of a few rows with dynamic activations: the SwiGLU in the gate|up GEMV's epilogue, and o_proj /
    # down_proj quantizing their inputs themselves (int8_gemm.DeferredQuant; the same bits)
    defer_int8_quant: bool = True
    # the lm_head as int8 codes with an fp32 scale per vocabulary row (made at load from the fp16 head): what a
    # decode step reads of it halves. Its cost in quality is in docs/quality.md; off by default, since the
    # checkpoint's fp16 head is what other engines run
    lm_head_int8: bool = False
    # decode steps the generation loop keeps queued ahead of reading their tokens (engine/pipe.py): 2 hides the
    # host's per-token work behind the next step; the third absorbs a slow token (a GC pause, a long stream write)
    pipe_depth: int = 3

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kv", KvKind(self.kv))  # "int8" as well as KvKind.INT8
        except ValueError:
            raise ConfigError(f"kv must be one of {', '.join(k.value for k in KvKind)}, got {self.kv!r}") from None
        if self.pipe_depth < 1:
            raise DeviceError(f"pipe_depth must be >= 1, got {self.pipe_depth}")
