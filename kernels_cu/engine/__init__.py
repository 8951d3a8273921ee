"""The GPU engine (engine.py), one concern a file: the plan of a decode step (plan.py), the decoder layer
(layer.py), the linears per scheme (linears.py), the KV cache (cache.py), graphs and stream order (graphs.py), the
lm_head (head.py), the sampler (sampler.py) and what a user configures (config.py)."""

from kernels_cu.engine.cache import GpuCache
from kernels_cu.engine.config import BUCKETS, EngineConfig
from kernels_cu.engine.engine import Engine
from kernels_cu.engine.sampler import GpuRowSampler
from kernels_cu.kv_codes import KvKind

__all__ = ["BUCKETS", "Engine", "EngineConfig", "GpuCache", "GpuRowSampler", "KvKind"]
