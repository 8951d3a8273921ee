"""Quantized Linear layers of the reference backend: the exact numerics the GPU kernels implement.

Int8Linear: W8A8; activations quantized per token or with one calibrated amax, exact int32 GEMM,
fp32 dequant epilogue (model_zoo/quant/int8.py). Fp8Linear: FP8 E4M3 W8A8; activations quantized to e4m3 per token
or with one calibrated scale, fp32 GEMM of the codes, fp32 scale epilogue (model_zoo/quant/fp8.py). AwqLinear: W4A16; the weight is dequantized as (q - z) * s in the
activation dtype and multiplied densely (model_zoo/quant/awq_pack.py). Both implement model_zoo.linear.Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_zoo.errors import ConfigError
from model_zoo.quant.awq_pack import check_awq_shape, dequantize_awq, quantize_awq
from model_zoo.quant.fp8 import FP8_DTYPE, dequantize_weight_fp8, fp8_linear_ref, quantize_weight_fp8
from model_zoo.quant.int8 import ActQuant, dequantize_weight_int8, int8_linear_ref, quantize_weight_int8

__all__ = ["ActQuant", "Int8Linear", "Fp8Linear", "AwqLinear"]


class Int8Linear:
    """qweight int8 [N, K] with w_scale fp32 [N]; `a_amax` is the static activation range (fp32), if any."""

    def __init__(self, qweight: torch.Tensor, w_scale: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC,
                 a_amax: float | None = None, dtype: torch.dtype = torch.float16):
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ConfigError(f"Int8Linear needs an int8 [N, K] weight, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        if w_scale.numel() != self.out_features:
            raise ConfigError(f"w_scale has {w_scale.numel()} entries for {self.out_features} output channels")
        act = ActQuant(act)
        if (act is ActQuant.STATIC) != (a_amax is not None):
            raise ConfigError("a static Int8Linear needs a_amax; a dynamic one takes none")
        if a_amax is not None and not (a_amax > 0 and a_amax < float("inf")):
            raise ConfigError(f"a_amax must be positive and finite, got {a_amax}")
        self.qweight = qweight  # [N, K]
        self.w_scale = w_scale.float().reshape(self.out_features)  # [N]
        self.act = act
        self.a_amax = None if a_amax is None else float(torch.tensor(a_amax, dtype=torch.float32))
        self.dtype = dtype  # of dense_weight(); __call__ follows x.dtype
        self._qweight_f: torch.Tensor | None = None  # the codes in fp32, made on first use

    @classmethod
    def from_dense(cls, w: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC, a_amax: float | None = None,
                   scale_dtype: torch.dtype | None = None) -> "Int8Linear":
        """Quantize a float W [N, K] per output channel (see quantize_weight_int8 for scale_dtype)."""
        qweight, w_scale = quantize_weight_int8(w, scale_dtype)
        return cls(qweight, w_scale, act, a_amax, dtype=w.dtype if w.is_floating_point() else torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._qweight_f is None:
            self._qweight_f = self.qweight.float()  # [N, K]
        return int8_linear_ref(x, self._qweight_f, self.w_scale, self.act, self.a_amax)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_weight_int8(self.qweight, self.w_scale, self.dtype)  # [N, K]

    def to(self, device=None, dtype=None) -> "Int8Linear":
        # Codes and scales keep their storage dtypes; `dtype` only sets the model dtype of dense_weight().
        return Int8Linear(self.qweight.to(device), self.w_scale.to(device), self.act, self.a_amax,
                          dtype=dtype or self.dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.w_scale.numel() * 4 + (4 if self.a_amax is not None else 0)

    def __repr__(self) -> str:
        return f"Int8Linear({self.in_features} -> {self.out_features}, act={self.act.value})"


class Fp8Linear:
    """weight8 float8_e4m3fn [N, K] with w_scale fp32 [N]; `a_scale` is the static activation scale (fp32), if any.

    What the kernels must reproduce (model_zoo/quant/fp8.py has the whole contract):
      a_scale[m] = max(max|x[m, :]|, 1e-8) / 448 (dynamic, per token) or the stored scale (static, per tensor);
      x8 = e4m3(clamp(x * (1 / a_scale[m]), -448, 448)), round to nearest even: bit-exact codes;
      y[m, n] = ((sum_k float(x8[m, k]) * float(w8[n, k])) * a_scale[m]) * w_scale[n], all in fp32, in this
      order, then cast to x's dtype; only the fp32 summation order may differ.
    A per-tensor weight scale (other tools' checkpoints) is expanded to [N]: the same numbers.
    """

    def __init__(self, weight8: torch.Tensor, w_scale: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC,
                 a_scale: float | None = None, dtype: torch.dtype = torch.float16):
        if weight8.dtype != FP8_DTYPE or weight8.dim() != 2:
            raise ConfigError(f"Fp8Linear needs a float8_e4m3fn [N, K] weight, got {weight8.dtype} "
                              f"{tuple(weight8.shape)}")
        self.out_features, self.in_features = weight8.shape
        if w_scale.numel() not in (1, self.out_features):
            raise ConfigError(f"w_scale has {w_scale.numel()} entries for {self.out_features} output channels")
        w_scale = w_scale.float().reshape(-1).expand(self.out_features).contiguous()  # [N]
        if not torch.isfinite(w_scale).all() or (w_scale <= 0).any():
            raise ConfigError("fp8 weight scales must be positive and finite")
        act = ActQuant(act)
        if (act is ActQuant.STATIC) != (a_scale is not None):
            raise ConfigError("a static Fp8Linear needs a_scale; a dynamic one takes none")
        if a_scale is not None and not (a_scale > 0 and a_scale < float("inf")):
            raise ConfigError(f"a_scale must be positive and finite, got {a_scale}")
        self.weight8 = weight8  # [N, K]
        self.w_scale = w_scale  # [N]
        self.act = act
        self.a_scale = None if a_scale is None else float(torch.tensor(a_scale, dtype=torch.float32))
        self.dtype = dtype  # of dense_weight(); __call__ follows x.dtype
        self._weight_f: torch.Tensor | None = None  # the codes in fp32, made on first use

    @classmethod
    def from_dense(cls, w: torch.Tensor, act: ActQuant = ActQuant.DYNAMIC,
                   a_scale: float | None = None) -> "Fp8Linear":
        """Quantize a float W [N, K] per output channel (scale = amax / 448, fp32)."""
        weight8, w_scale = quantize_weight_fp8(w)
        return cls(weight8, w_scale, act, a_scale, dtype=w.dtype if w.is_floating_point() else torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight_f is None:
            self._weight_f = self.weight8.float()  # [N, K]
        return fp8_linear_ref(x, self._weight_f, self.w_scale, self.act, self.a_scale)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_weight_fp8(self.weight8, self.w_scale, self.dtype)  # [N, K]

    def to(self, device=None, dtype=None) -> "Fp8Linear":
        # Codes and scales keep their storage dtypes; `dtype` only sets the model dtype of dense_weight().
        return Fp8Linear(self.weight8.to(device), self.w_scale.to(device), self.act, self.a_scale,
                         dtype=dtype or self.dtype)

    def nbytes(self) -> int:
        return self.weight8.numel() + self.w_scale.numel() * 4 + (4 if self.a_scale is not None else 0)

    def __repr__(self) -> str:
        return f"Fp8Linear({self.in_features} -> {self.out_features}, act={self.act.value})"


class AwqLinear:
    """AutoAWQ GEMM tensors: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 dtype: torch.dtype = torch.float16):
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or not scales.is_floating_point():
            raise ConfigError(f"AwqLinear needs int32 qweight/qzeros and float scales, got "
                              f"{qweight.dtype}, {qzeros.dtype}, {scales.dtype}")
        self.in_features, self.out_features = qweight.shape[0], scales.shape[-1]
        check_awq_shape(self.in_features, self.out_features, group_size)
        groups, words = self.in_features // group_size, self.out_features // 8
        if (tuple(qweight.shape) != (self.in_features, words) or tuple(qzeros.shape) != (groups, words)
                or tuple(scales.shape) != (groups, self.out_features)):
            raise ConfigError(f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                              f"scales {tuple(scales.shape)} for group size {group_size}")
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales  # [K, N/8], [K/G, N/8], [K/G, N]
        self.group_size = group_size
        self.dtype = dtype  # of dense_weight(); __call__ follows x.dtype
        self._w_hat: torch.Tensor | None = None  # the last dequantized weight, reused while x.dtype stays

    @classmethod
    def from_dense(cls, w: torch.Tensor, group_size: int, clip_max: torch.Tensor | None = None) -> "AwqLinear":
        """Round-to-nearest int4 of a float W [N, K] (AWQ's scale search happens before, on W)."""
        qweight, qzeros, scales = quantize_awq(w, group_size, clip_max)
        return cls(qweight, qzeros, scales, group_size, dtype=w.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._w_hat is None or self._w_hat.dtype != x.dtype:
            self._w_hat = dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size, x.dtype)  # [N, K]
        return F.linear(x, self._w_hat)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size, self.dtype)  # [N, K]

    def to(self, device=None, dtype=None) -> "AwqLinear":
        # Packed codes and fp16 scales stay as stored; `dtype` only sets the model dtype of dense_weight().
        return AwqLinear(self.qweight.to(device), self.qzeros.to(device), self.scales.to(device),
                         self.group_size, dtype=dtype or self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))

    def __repr__(self) -> str:
        return f"AwqLinear({self.in_features} -> {self.out_features}, group_size={self.group_size})"
