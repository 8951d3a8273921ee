"""Symmetric INT8 (W8A8) numerics: the contract the GPU kernels and the CPU reference share.

Weights: one scale per output channel, w_scale[n] = max|W[n, :]| / 127.
Activations: one scale per token (computed at run time) or one per tensor (from calibration);
q = clamp(rint(x * (127 / amax)), -127, 127), a_scale = amax / 127, all in fp32.
GEMM: int32 accumulation, then y = (float(acc) * a_scale[m]) * w_scale[n] in fp32, cast to x's dtype.
Rounding is round-half-even everywhere (torch.round == CUDA rint / __float2int_rn).
The scale convention (x ~ q * scale) is compressed-tensors' too, so export only changes dtypes.
"""

from __future__ import annotations

from enum import Enum

import torch

from model_zoo.errors import ConfigError

QMAX = 127  # symmetric: -128 is never produced, so negation and the kernels' bias trick stay exact
AMAX_MIN = 1e-8  # an all-zero row or channel still gets a finite scale
# fp32 holds every integer up to 2^24 exactly; |q_x * q_w| <= 128 * 128 = 2^14, so 1024 products sum exactly.
_FP32_EXACT_CHUNK = 1024
# int32 accumulation cannot overflow below this many inputs (the kernels accumulate in int32).
MAX_IN_FEATURES = (2**31 - 1) // (128 * 128)


class ActQuant(str, Enum):
    """Where the activation scale of an INT8 linear comes from."""

    DYNAMIC = "dynamic"  # per token, computed from each row at run time
    STATIC = "static"  # one per tensor, from calibration


def quantize_weight_int8(w: torch.Tensor, scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (qweight int8 [N, K], w_scale fp32 [N]) with W ~ qweight * w_scale[:, None].

    `scale_dtype` (e.g. fp16, the dtype a checkpoint stores the scale in) first rounds each scale to that
    dtype, so the codes are the best ones for the scale that will be written and export loses nothing.
    """
    _check_2d(w, "weight")
    amax = w.detach().float().abs().amax(dim=1).clamp(min=AMAX_MIN)  # [N]
    w_scale = amax / QMAX  # [N]
    if scale_dtype is not None:
        w_scale = w_scale.to(scale_dtype).float()
        if not torch.isfinite(w_scale).all() or (w_scale <= 0).any():
            raise ConfigError(f"weight scales do not fit in {scale_dtype}; store them as float32")
    qweight = torch.round(w.float() / w_scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)  # [N, K]
    return qweight, w_scale


def dequantize_weight_int8(qweight: torch.Tensor, w_scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight int8 [N, K], w_scale [N]) -> W [N, K] in `dtype` (product taken in fp32)."""
    return (qweight.float() * w_scale.float().reshape(-1, 1)).to(dtype)  # [N, K]


def quantize_act_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], a_scale fp32 [...]), one scale per row (token)."""
    q, a_scale = act_codes(x, ActQuant.DYNAMIC, None)
    return q.to(torch.int8), a_scale


def quantize_act_static(x: torch.Tensor, amax: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q int8 [..., K], a_scale fp32 [...]) with one calibrated amax (used as fp32)."""
    q, a_scale = act_codes(x, ActQuant.STATIC, amax)
    return q.to(torch.int8), a_scale


def quantize_act(x: torch.Tensor, act: ActQuant, a_amax: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token or static quantization of x [..., K], chosen by `act`: (q int8, a_scale fp32 [...])."""
    q, a_scale = act_codes(x, act, a_amax)
    return q.to(torch.int8), a_scale


def act_codes(x: torch.Tensor, act: ActQuant, a_amax: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes of x [..., K] held in fp32 (exact integers; saves conversions), and a_scale [...]."""
    xf = x.float()
    if act is ActQuant.DYNAMIC:
        amax = xf.abs().amax(dim=-1).clamp(min=AMAX_MIN)  # [...]
    else:
        if a_amax is None:
            raise ConfigError("static activation quantization needs a calibrated amax")
        amax = torch.as_tensor(a_amax, dtype=torch.float32, device=x.device).reshape(())
        if not torch.isfinite(amax) or amax <= 0:
            raise ConfigError(f"a static activation range must be positive and finite, got {float(amax)}")
        amax = amax.clamp(min=AMAX_MIN).expand(xf.shape[:-1])  # [...]
    # The kernels compute inv = 127 / amax once and multiply (no per-element division): do the same.
    inv = QMAX / amax  # [...]
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-QMAX, QMAX)  # [..., K]
    return q, amax / QMAX


def int8_matmul(q_x: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Exact int32 q_x [M, K] @ qweight[N, K]^T -> acc int32 [M, N], as the int8 tensor cores compute it."""
    _check_2d(q_x, "activation codes")
    _check_2d(qweight, "weight codes")
    if q_x.dtype != torch.int8 or qweight.dtype != torch.int8:
        raise ConfigError(f"int8_matmul needs int8 operands, got {q_x.dtype} and {qweight.dtype}")
    if qweight.shape[1] != q_x.shape[1]:
        raise ConfigError(f"inner sizes differ: activation K={q_x.shape[1]}, weight K={qweight.shape[1]}")
    return exact_int_matmul(q_x.float(), qweight.float())


def exact_int_matmul(xf: torch.Tensor, wf: torch.Tensor) -> torch.Tensor:
    """xf [M, K] @ wf [N, K]^T -> int32 [M, N] for float tensors holding integer codes in -128..127."""
    k = xf.shape[1]
    if k > MAX_IN_FEATURES:
        raise ConfigError(f"K={k} could overflow int32 accumulation (at most {MAX_IN_FEATURES})")
    if not _fp32_matmul_is_ieee(xf.device):
        # TF32/bf16 matmul settings would round: float64 holds every partial sum exactly.
        return (xf.double() @ wf.double().T).to(torch.int32)  # [M, N]
    acc = None
    for k0 in range(0, max(k, 1), _FP32_EXACT_CHUNK):
        part = xf[:, k0:k0 + _FP32_EXACT_CHUNK] @ wf[:, k0:k0 + _FP32_EXACT_CHUNK].T  # [M, N], exact below 2^24
        acc = part.to(torch.int32) if acc is None else acc.add_(part.to(torch.int32))
    return acc


def dequant_epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """acc int32 [M, N] -> (float(acc) * a_scale[m]) * w_scale[n] in fp32 (two roundings, in this order)."""
    y = acc.float() * a_scale.float().reshape(-1, 1)  # [M, N]
    return (y * w_scale.float().reshape(1, -1)).to(out_dtype)


def int8_gemm_ref(q_x: torch.Tensor, qweight: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = (float(acc) * a_scale[m]) * w_scale[n] in fp32, cast to out_dtype (the dequant epilogue)."""
    return dequant_epilogue(int8_matmul(q_x, qweight), a_scale, w_scale, out_dtype)


def int8_linear_ref(x: torch.Tensor, qweight_f: torch.Tensor, w_scale: torch.Tensor, act: ActQuant,
                    a_amax: float | None) -> torch.Tensor:
    """The whole W8A8 linear for x [..., K] with the weight codes held in fp32 ([N, K]); returns x.dtype."""
    q, a_scale = act_codes(x.reshape(-1, x.shape[-1]), act, a_amax)  # [M, K], [M]
    y = dequant_epilogue(exact_int_matmul(q, qweight_f), a_scale, w_scale, x.dtype)  # [M, N]
    return y.reshape(*x.shape[:-1], qweight_f.shape[0])


def fake_quant_linear(x: torch.Tensor, w: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC,
                      a_amax: float | None = None) -> torch.Tensor:
    """y [..., N] for x [..., K] and a float W [N, K], through the full W8A8 path; returns x.dtype."""
    qweight, w_scale = quantize_weight_int8(w)
    return int8_linear_ref(x, qweight.float(), w_scale, act, a_amax)


def _fp32_matmul_is_ieee(device: torch.device) -> bool:
    if device.type != "cpu":
        return False  # CUDA may use TF32 behind a global flag; the reference stays exact anyway
    if torch.get_float32_matmul_precision() != "highest":
        return False
    mkldnn = getattr(torch.backends, "mkldnn", None)
    precision = getattr(getattr(mkldnn, "matmul", None), "fp32_precision", "ieee")
    return precision in ("ieee", "none")


def _check_2d(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2:
        raise ConfigError(f"{what} must be 2-D [rows, cols], got shape {tuple(t.shape)}")
