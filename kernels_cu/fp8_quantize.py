"""FP8 E4M3 quantization of an fp16 matrix (fp8_quantize.cu): an fp8 linear's input, by model_zoo/quant/fp8.py's rule.

    a_scale[row] = max(max|x| over the row, 1e-8) / 448      dynamic (per token), fp32, IEEE division
                 = static_scale                              static (one calibrated fp32 scale), written per row
    x8 = e4m3(clamp(x * (1 / a_scale[row]), -448, 448))       round to nearest even

The kernel reproduces fp8_quantize_ref bit for bit (codes and scales), and so model_zoo's quantize_act_fp8*.
`fp8_rmsnorm` (optionally after the residual add) and `fp8_silu_mul` (an interleaved gate|up product) quantize the
rows they make in the same kernel (int8's rmsnorm_quant / silu_mul_quant rows on this rule): the bits of the fp16 kernel
followed by fp8_quantize, one pass over the rows fewer.
E4M3 needs compute capability 8.9 (Ada) or newer: `require_fp8` says so in one line elsewhere.
"""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_multiple, check_static_amax, check_tensor, out_or_new, row_launch, silu_row_launch
from kernels_cu.gemm_shapes import cdiv
from kernels_cu.quantize import check_fold_inputs
from kernels_cu.rmsnorm import SIGNATURE as NORM_SIGNATURE
from kernels_cu.rmsnorm import check_inputs, rmsnorm_ref
from kernels_cu.swiglu_layout import swiglu_interleaved
from model_zoo.errors import DeviceError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-8
SIGNATURE = "PPPPi"  # x8, a_scale, static_scale, x, K
FOLD_SIGNATURE = "PPPPPPifi"  # fp8_quantize_fold: x8, a_scale, mx, sq, static_scale, x, K, eps, C
SILU_SIGNATURE = "PPPPi"  # fp8_silu_mul: x8, a_scale, static_scale, gate_up (interleaved), F
FOLD_VALUES = 1024  # values of a row one fp8_quantize_fold block quantizes
MIN_CAPABILITY = (8, 9)  # cvt e4m3x2 <-> f16x2 / f32 (Ada, Hopper and newer)


def has_fp8(device_index: int) -> bool:
    """Whether the GPU has the e4m3 conversions the fp8 kernels use (compute capability 8.9 or newer)."""
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def require_fp8(device_index: int) -> None:
    """One clear line (DeviceError) on a GPU without FP8 E4M3 instructions."""
    if not has_fp8(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        raise DeviceError(f"FP8 (E4M3) checkpoints need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                          f"{torch.cuda.get_device_name(device_index)} is {major}.{minor}: run it with --device cpu, "
                          "or use an int8 or fp16 checkpoint")


def check_static_scale(static_scale: torch.Tensor | None) -> None:
    """A static activation scale: None (dynamic per token) or one fp32 value on the device."""
    check_static_amax(static_scale, "static_scale")


def fp8_quantize_ref(x: torch.Tensor, static_scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """x [T, K] (fp16 values used as they are) -> (x8 float8_e4m3fn [T, K], a_scale fp32 [T]), the kernel's bits."""
    x32 = x.float()
    if static_scale is None:
        amax = x32.abs().amax(dim=-1).clamp_min(MIN_AMAX)  # [T]
        # tensor / tensor: torch on CUDA turns division by a Python scalar into a reciprocal multiply
        a_scale = amax / torch.full_like(amax, FP8_MAX)  # [T]
    else:
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device).reshape(())
        a_scale = s.expand(x.shape[0]).contiguous()  # [T]
    inv = torch.ones_like(a_scale) / a_scale  # [T] one IEEE division per row
    return (x32 * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), a_scale  # [T, K], [T]


def fp8_quantize(x: torch.Tensor, static_scale: torch.Tensor | None = None, x8: torch.Tensor | None = None,
                 a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 x [T, K] -> (x8 float8_e4m3fn [T, K], a_scale fp32 [T]); static_scale: fp32 [1] on the GPU, or None
    for per-token scales. x8 / a_scale: outputs to write, else new."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got shape {tuple(x.shape)}")
    T, K = x.shape
    check_multiple(K, 8, "the fp8-quantized width")
    check_tensor(x, "x", torch.float16)
    check_static_scale(static_scale)
    with build.on_stream():
        x8 = out_or_new(x8, (T, K), FP8, x, "x8", align=8)
        a_scale = out_or_new(a_scale, (T,), torch.float32, x, "a_scale", align=4)
        if T == 0:
            return x8, a_scale
        nv, threads = row_launch(K // 8)
        mode = "dyn" if static_scale is None else "static"
        fn = build.get_function("fp8_quantize.cu", f"fp8_quantize_{mode}_nv{nv}", SIGNATURE)
        fn((T,), (threads,), x8, a_scale, static_scale, x, K)
    return x8, a_scale


def fp8_quantize_fold(x: torch.Tensor, mx: torch.Tensor, sq: torch.Tensor | None = None, eps: float = 0.0,
                      static_scale: torch.Tensor | None = None, values: bool = False) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """A deferred input's codes (fp8_quantize.cu's fp8_quantize_fold; the row spread over blocks): x fp16 [T, K] with
    C partial maxima mx fp32 [T, C] of each row -> fp8_quantize(x)'s bits; with sq fp32 [T, C] (sums of h^2) x is an
    RMSNorm's xg = h * w deferred into its producer (norm_fold.py, int8's format) -> its codes by its own max and
    a_scale times rstd (dynamic), or the codes of x * rstd / scale (static), as fp8_gemm.fp8_fold_quantize_ref says.
    values: the codes as their exact fp16 values [T, K] (what fp8_gemm's fp16-activation GEMV takes)."""
    T, K, C = check_fold_inputs(x, mx, sq, None, None)
    check_static_scale(static_scale)
    with build.on_stream():
        x8 = torch.empty((T, K), dtype=torch.float16 if values else FP8, device=x.device)  # [T, K]
        a_scale = torch.empty((T,), dtype=torch.float32, device=x.device)  # [T]
        if T:
            fn = build.get_function("fp8_quantize.cu", "fp8_quantize_fold_h" if values else "fp8_quantize_fold",
                                    FOLD_SIGNATURE)
            fn((cdiv(K, FOLD_VALUES), T), (256,), x8, a_scale, mx, sq, static_scale, x, K, float(eps), C)
    return x8, a_scale


def fp8_rmsnorm_ref(h: torch.Tensor, w: torch.Tensor, eps: float, static_scale=None,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quantize_ref of rmsnorm_ref(h, w, eps, residual) (the norm of fp16(residual + h) with residual)."""
    return fp8_quantize_ref(rmsnorm_ref(h, w, eps, residual), static_scale)


def fp8_rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 h [T, H], norm weight w [H] -> (x8 float8_e4m3fn [T, H], a_scale fp32 [T]) = fp8_quantize(rmsnorm(h)),
    the same bits in one kernel. residual fp16 [T, H]: residual += h first (in place, fp16), then its norm
    (add_rmsnorm's order)."""
    T, H = check_inputs(h, w, residual)
    check_static_scale(static_scale)
    with build.on_stream():
        x8 = torch.empty((T, H), dtype=FP8, device=h.device)  # [T, H]
        a_scale = torch.empty((T,), dtype=torch.float32, device=h.device)  # [T]
        if T:
            nv, threads = row_launch(H // 8)
            mode = ("add_" if residual is not None else "") + ("dyn" if static_scale is None else "static")
            fn = build.get_function("fp8_quantize.cu", f"fp8_rmsnorm_{mode}_nv{nv}", NORM_SIGNATURE)
            fn((T,), (threads,), None, x8, a_scale, static_scale, residual, h, w, H, float(eps))
    return x8, a_scale


def fp8_silu_mul_ref(y: torch.Tensor, static_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quantize_ref of swiglu_interleaved(y): y [T, 2F] in the interleaved gate|up column order."""
    return fp8_quantize_ref(swiglu_interleaved(y), static_scale)


def fp8_silu_mul(y: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An interleaved gate|up product y fp16 [T, 2F] (swiglu_layout.py) -> the codes of silu(gate) * up
    (x8 float8_e4m3fn [T, F], a_scale fp32 [T]): silu_mul_interleaved + fp8_quantize's bits in one kernel."""
    if y.dim() != 2 or y.shape[1] % 16:
        raise ValueError(f"y must be [T, 2F] with 2F a multiple of 16 (panels of 8 gate and 8 up columns), "
                         f"got shape {tuple(y.shape)}")
    check_tensor(y, "y", torch.float16)
    check_static_scale(static_scale)
    T, F_ = y.shape[0], y.shape[1] // 2
    with build.on_stream():
        x8 = torch.empty((T, F_), dtype=FP8, device=y.device)  # [T, F]
        a_scale = torch.empty((T,), dtype=torch.float32, device=y.device)  # [T]
        if T:
            nv, threads = silu_row_launch(F_ // 8)
            mode = "dyn" if static_scale is None else "static"
            fn = build.get_function("fp8_quantize.cu", f"fp8_silu_mul_{mode}_nv{nv}", SILU_SIGNATURE)
            fn((T,), (threads,), x8, a_scale, static_scale, y, F_)
    return x8, a_scale
