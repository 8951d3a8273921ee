"""SwiGLU activation (silu_mul.cu): silu(gate) * up from the fused gate|up output, optionally int8-quantized
(dynamic per token or static per tensor, quantize.quantize_ref's rule) for the down projection, a row spread over
blocks up to tuning.silu_split_max_rows rows; and from a product in swiglu_layout.py's interleaved column order
(`silu_mul_interleaved`, the fp16 path beyond the GEMV)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_cu import build, tuning
from kernels_cu.checks import check_multiple, check_static_amax, check_tensor, out_or_new, silu_row_launch
from kernels_cu.gemm_shapes import cdiv
from kernels_cu.quantize import PARTS_VALUES, quantize_fold, quantize_ref

SIGNATURE = "PPPPPi"  # out, q, a_scale, static_amax, gate_up, F
PART_SIGNATURE = "PPPPPPi"  # y, part, q, a_scale, static_amax, gate_up, F
PART_VALUES = PARTS_VALUES  # silu_mul_part: 128 threads of 8 values a block, as quantize_fold's
INTERLEAVED_SIGNATURE = "PPq"  # out, y, n_panels
INTERLEAVED_THREADS = 256  # one thread per 16-column panel


def silu_mul_ref(gate_up: torch.Tensor, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate_up [T, 2F] -> silu(gate) * up [T, F]; in gate_up's dtype as transformers does (compute_dtype None),
    or entirely in compute_dtype (float64) as the high-precision oracle."""
    g, u = gate_up.chunk(2, dim=-1)  # [T, F] each
    if compute_dtype is not None:
        g, u = g.to(compute_dtype), u.to(compute_dtype)
    return F.silu(g) * u


def silu_mul_quant_ref(gate_up: torch.Tensor, static_amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_ref(silu_mul_ref(gate_up), static_amax)


def _check(gate_up: torch.Tensor) -> tuple[int, int]:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2F], got shape {tuple(gate_up.shape)}")
    T, F2 = gate_up.shape
    check_multiple(F2 // 2, 8, "the FFN size")
    check_tensor(gate_up, "gate_up", torch.float16)
    return T, F2 // 2


def _launch(mode: str, T: int, F_: int, out=None, q=None, a_scale=None, static_amax=None, gate_up=None) -> None:
    if T == 0:
        return
    check_static_amax(static_amax)
    nv, threads = silu_row_launch(F_ // 8)
    fn = build.get_function("silu_mul.cu", f"silu_mul_{mode}_nv{nv}", SIGNATURE)
    fn((T,), (threads,), out, q, a_scale, static_amax, gate_up, F_)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 gate_up [T, 2F] -> fp16 [T, F]."""
    T, F_ = _check(gate_up)
    out = out_or_new(out, (T, F_), torch.float16, gate_up, "out")
    _launch("plain", T, F_, out=out, gate_up=gate_up)
    return out


def silu_mul_quant(gate_up: torch.Tensor, static_amax: torch.Tensor | None = None, q: torch.Tensor | None = None,
                   a_scale: torch.Tensor | None = None, split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 gate_up [T, 2F] -> (q int8 [T, F], a_scale fp32 [T]). split: each row over several blocks (the same
    bits; by default up to tuning.silu_split_max_rows rows)."""
    T, F_ = _check(gate_up)
    q = out_or_new(q, (T, F_), torch.int8, gate_up, "q", align=8)
    a_scale = out_or_new(a_scale, (T,), torch.float32, gate_up, "a_scale", align=4)
    mode = "dyn" if static_amax is None else "static"
    if split is None:
        split = T <= tuning.current().silu_split_max_rows
    if not split or T == 0:
        _launch(mode, T, F_, q=q, a_scale=a_scale, static_amax=static_amax, gate_up=gate_up)
        return q, a_scale
    check_static_amax(static_amax)
    blocks = cdiv(F_, PART_VALUES)
    y = part = None
    if static_amax is None:  # the fp16 values and each block's absmax, for quantize_fold
        y = torch.empty((T, F_), dtype=torch.float16, device=gate_up.device)  # [T, F]
        part = torch.empty((T, blocks), dtype=torch.float32, device=gate_up.device)  # [T, C]
    fn = build.get_function("silu_mul.cu", f"silu_mul_part_{mode}", PART_SIGNATURE)
    fn((blocks, T), (PART_VALUES // 8,), y, part, q, a_scale, static_amax, gate_up, F_)
    if static_amax is None:
        quantize_fold(y, part, None, 0.0, q=q, a_scale=a_scale)
    return q, a_scale


def silu_mul_interleaved(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 y [M, 2F] in the interleaved gate|up column order (swiglu_layout.py) -> silu(gate) * up fp16 [M, F],
    the bits of swiglu_layout.swiglu_interleaved (its reference)."""
    if y.dim() != 2 or y.shape[1] % 16:
        raise ValueError(f"y must be [M, 2F] with 2F a multiple of 16 (panels of 8 gate and 8 up columns), "
                         f"got shape {tuple(y.shape)}")
    check_tensor(y, "y", torch.float16)
    M, F_ = y.shape[0], y.shape[1] // 2
    out = out_or_new(out, (M, F_), torch.float16, y, "out")
    n_panels = M * F_ // 8  # one thread each: [M, F/8] flattened
    if n_panels:
        fn = build.get_function("silu_mul.cu", "silu_mul_interleaved", INTERLEAVED_SIGNATURE)
        fn((cdiv(n_panels, INTERLEAVED_THREADS),), (INTERLEAVED_THREADS,), out, y, n_panels)
    return out
