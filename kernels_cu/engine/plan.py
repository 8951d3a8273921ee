"""Which kernels a decode step of m rows runs: the plan the engine reads before a step (and before its capture).

Small steps are latency-bound, so they defer work into the kernels around it: the RMSNorms into the GEMVs that
produce and consume them (norm_fold.py), and, for int8 and fp8, the activation quantizations into the
GEMVs that take them (int8_gemm.DeferredQuant / NormQuant, fp8_gemm.FoldQuant). Each deferral has a row limit in
tuning.py past which it costs more than the kernel it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kernels_cu import norm_fold
from kernels_cu.engine.config import EngineConfig
from kernels_cu.fp16_gemv import DECODE_MAX_M
from kernels_cu.tuning import Tuning


@dataclass(frozen=True)
class StepPlan:
    fold: bool = False  # fp16 / AWQ: the RMSNorms deferred into the GEMVs (the embedding writes layer 0's)
    int8_fold: bool = False  # int8, fp8: o_proj / down_proj write the next norm's inputs; the final norm stays a kernel
    defer_o: bool = False  # int8, fp8: o_proj quantizes attention's fp16 output itself
    defer_down: bool = False  # int8, fp8: down_proj quantizes the SwiGLU that the gate|up GEMV's epilogue wrote
    row_amax: bool = False  # ... and that GEMV writes each row's max for it (a buffer of the cache)

    @property
    def folds_any(self) -> bool:
        return self.fold or self.int8_fold


PREFILL = StepPlan()  # prefill runs every kernel in full


def _ops(layers: Sequence[Any]) -> list:
    return [op for l in layers for op in (l.qkv, l.o, l.gate_up, l.down)]


def folds(layers: Sequence[Any], scheme: str, hidden: int, cfg: EngineConfig, t: Tuning, m: int) -> bool:
    """fp16 / AWQ: up to the scheme's row limit, every linear on a GEMV that takes the fold."""
    if not cfg.fold_norms or not norm_fold.takes(hidden):
        return False
    limit = {"fp16": t.fold_max_rows_fp16, "awq": t.fold_max_rows_awq}.get(scheme, 0)
    return m <= min(limit, DECODE_MAX_M) and all(op.folds(m) for op in _ops(layers))


def folds_int8(layers: Sequence[Any], hidden: int, cfg: EngineConfig, t: Tuning, m: int) -> bool:
    """int8: up to the GEMVs' DECODE_MAX_M rows, where o_proj and down_proj are the GEMVs that write the norm's
    inputs."""
    if not (cfg.fold_norms and t.fold_int8 and norm_fold.takes(hidden)):
        return False
    return m <= DECODE_MAX_M and all(op.int8 for op in _ops(layers))


def defers_quant(layers: Sequence[Any], cfg: EngineConfig, t: Tuning, m: int) -> bool:
    """int8 with dynamic activations and RoPE inside attention: o_proj and down_proj quantize their inputs."""
    if not (cfg.defer_int8_quant and cfg.fuse_rope) or m > t.defer_quant_max_rows:
        return False
    return all(l.o.int8 and l.gate_up.int8 and l.down.int8 and l.o.amax is None and l.down.amax is None
               for l in layers)


def fp8_chain(layers: Sequence[Any], hidden: int, cfg: EngineConfig, t: Tuning, m: int) -> bool:
    """fp8 up to tuning.fp8_defer_max_rows rows on the GEMVs (below tuning.fp8_library_min_m, from which cuBLASLt
    takes the products): int8's deferred chain, where every linear is fp8 and o_proj / down_proj share one
    activation mode (dynamic: their inputs quantized from the maxima attention and the gate|up GEMV wrote)."""
    gemv_rows = min(t.fp8_defer_max_rows, t.fp8_gemv_max_m, t.fp8_library_min_m - 1)
    if not (m <= gemv_rows and cfg.fold_norms and cfg.fuse_rope
            and norm_fold.takes(hidden)):
        return False
    if not all(getattr(op, "fp8", False) for op in _ops(layers)):
        return False
    return len({op.static_scale is None for l in layers for op in (l.o, l.down)}) == 1


def plan_step(layers: Sequence[Any], scheme: str, hidden: int, cfg: EngineConfig, t: Tuning, m: int) -> StepPlan:
    """The plan of a decode step of m rows (the bucket's size)."""
    if fp8_chain(layers, hidden, cfg, t, m):
        dynamic = layers[0].o.static_scale is None
        return StepPlan(int8_fold=True, defer_o=dynamic, defer_down=dynamic, row_amax=dynamic and m == 1)
    defer = defers_quant(layers, cfg, t, m)
    int8_fold = folds_int8(layers, hidden, cfg, t, m)
    defer_down = defer and t.defer_swiglu
    return StepPlan(fold=folds(layers, scheme, hidden, cfg, t, m), int8_fold=int8_fold,
                    defer_o=defer and t.defer_attention, defer_down=defer_down,
                    row_amax=defer_down and int8_fold and t.swiglu_row_amax)
