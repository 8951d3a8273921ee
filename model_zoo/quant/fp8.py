"""FP8 E4M3 (W8A8) numerics: the contract the GPU kernels and the CPU reference share.

The format is torch.float8_e4m3fn (OCP E4M3, "fn": no infinities, one NaN): 1 sign, 4 exponent (bias 7) and 3
mantissa bits; normals 2^-6 .. 448, subnormals down to 2^-9. A float becomes e4m3 by clamping to [-448, 448] and then
rounding to the nearest representable value, ties to even (torch's `.to(torch.float8_e4m3fn)`, CUDA's
`__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)` and `cvt.rn.satfinite.e4m3x2.f32` all give the same bits).

Weights: one fp32 scale per output channel, w_scale[n] = max(max|W[n, :]|, AMAX_MIN) / 448, and
w8[n, k] = e4m3(W[n, k] / w_scale[n]) (an fp32 division; offline, so kernels never redo it).
Activations, all in fp32:
  dynamic (per token): a_scale[m] = max(max|x[m, :]|, AMAX_MIN) / 448;
  static (per tensor): a_scale = the calibrated scale (compressed-tensors' input_scale = amax / 448);
  then inv = 1 / a_scale (one IEEE division per row or tensor, never per element),
  x8[m, k] = e4m3(clamp(x[m, k] * inv, -448, 448)).
GEMM: acc[m, n] = sum_k float(x8[m, k]) * float(w8[k, n]) in fp32 (each product of two e4m3 values is exact in fp32,
so only the order of the sums can differ), then y = (acc * a_scale[m]) * w_scale[n] in fp32 (two roundings, in
this order), cast to x's dtype. The codes x8 must match bit for bit; y agrees to fp32 summation-order tolerance.
"""

from __future__ import annotations

import torch

from model_zoo.errors import ConfigError
from model_zoo.quant.int8 import AMAX_MIN, ActQuant

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max

__all__ = ["FP8_DTYPE", "FP8_MAX", "to_e4m3", "quantize_weight_fp8", "dequantize_weight_fp8", "act_scale_fp8",
           "quantize_act_fp8", "quantize_act_fp8_per_token", "quantize_act", "fp8_gemm_ref", "fp8_linear_ref",
           "fake_quant_linear_fp8"]


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e4m3, saturating at +-448, round to nearest even (NaN stays NaN)."""
    return v.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (w8 float8_e4m3fn [N, K], w_scale fp32 [N]) with W ~ float(w8) * w_scale[:, None]."""
    _check_2d(w, "weight")
    amax = w.detach().float().abs().amax(dim=1).clamp(min=AMAX_MIN)  # [N]
    w_scale = amax / FP8_MAX  # [N]
    return to_e4m3(w.detach().float() / w_scale[:, None]), w_scale  # [N, K], [N]


def dequantize_weight_fp8(w8: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(w8 e4m3 [N, K], w_scale [N] or [1]) -> W [N, K] in `dtype` (product taken in fp32)."""
    return (w8.float() * w_scale.float().reshape(-1, 1)).to(dtype)  # [N, K]


def act_scale_fp8(x: torch.Tensor, act: ActQuant, a_scale: float | torch.Tensor | None) -> torch.Tensor:
    """The fp32 activation scale of each row of x [..., K]: shape [...] (a static scale expanded)."""
    if act is ActQuant.DYNAMIC:
        return x.float().abs().amax(dim=-1).clamp(min=AMAX_MIN) / FP8_MAX  # [...]
    if a_scale is None:
        raise ConfigError("static fp8 activation quantization needs a calibrated scale")
    s = torch.as_tensor(a_scale, dtype=torch.float32, device=x.device).reshape(())
    if not torch.isfinite(s) or s <= 0:
        raise ConfigError(f"a static fp8 activation scale must be positive and finite, got {float(s)}")
    return s.expand(x.shape[:-1])  # [...]


def quantize_act_fp8(x: torch.Tensor, a_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Static per-tensor: x [..., K] -> (x8 e4m3 [..., K], a_scale fp32 [...]) with one calibrated scale."""
    return _codes(x, act_scale_fp8(x, ActQuant.STATIC, a_scale))


def quantize_act_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per token: x [..., K] -> (x8 e4m3 [..., K], a_scale fp32 [...]), scale = max|row| / 448."""
    return _codes(x, act_scale_fp8(x, ActQuant.DYNAMIC, None))


def quantize_act(x: torch.Tensor, act: ActQuant, a_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token or static fp8 quantization of x [..., K], chosen by `act`: (x8 e4m3, a_scale fp32 [...])."""
    return _codes(x, act_scale_fp8(x, act, a_scale))


def _codes(x: torch.Tensor, a_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / a_scale  # [...]: the kernels divide once per row and multiply each element
    return to_e4m3(x.float() * inv.unsqueeze(-1)), a_scale  # [..., K], [...]


def fp8_gemm_ref(x8: torch.Tensor, w8: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = ((x8 @ w8^T in fp32) * a_scale[m]) * w_scale[n], cast to out_dtype (the fp8 GEMM epilogue)."""
    _check_2d(x8, "activation codes")
    _check_2d(w8, "weight codes")
    if x8.dtype != FP8_DTYPE or w8.dtype != FP8_DTYPE:
        raise ConfigError(f"fp8_gemm_ref needs float8_e4m3fn operands, got {x8.dtype} and {w8.dtype}")
    if x8.shape[1] != w8.shape[1]:
        raise ConfigError(f"inner sizes differ: activation K={x8.shape[1]}, weight K={w8.shape[1]}")
    return _epilogue(x8.float() @ w8.float().T, a_scale, w_scale, out_dtype)


def fp8_linear_ref(x: torch.Tensor, w8_f: torch.Tensor, w_scale: torch.Tensor, act: ActQuant,
                   a_scale: float | None) -> torch.Tensor:
    """The whole FP8 W8A8 linear for x [..., K], the weight codes held in fp32 ([N, K]); returns x.dtype."""
    x8, s = quantize_act(x.reshape(-1, x.shape[-1]), act, a_scale)  # [M, K], [M]
    y = _epilogue(x8.float() @ w8_f.T, s, w_scale, x.dtype)  # [M, N]
    return y.reshape(*x.shape[:-1], w8_f.shape[0])


def fake_quant_linear_fp8(x: torch.Tensor, w: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC,
                          a_scale: float | None = None) -> torch.Tensor:
    """y [..., N] for x [..., K] and a float W [N, K] through the full FP8 path; returns x.dtype."""
    w8, w_scale = quantize_weight_fp8(w)
    return fp8_linear_ref(x, w8.float(), w_scale, act, a_scale)


def _epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    y = acc * a_scale.float().reshape(-1, 1)  # [M, N]
    return (y * w_scale.float().reshape(1, -1)).to(out_dtype)


def _check_2d(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ConfigError(f"{what} must be 2-D [rows, cols], got shape {tuple(t.shape)}")
