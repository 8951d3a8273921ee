"""Quantized checkpoint layouts that other engines load (REFERENCE.md section 2), read and written.

INT8 W8A8 is compressed-tensors "int-quantized" (vLLM, transformers): `{m}.weight` int8 [N, K],
`{m}.weight_scale` [N, 1] with W ~ weight * weight_scale, and for static activations `{m}.input_scale` [1].
FP8 W8A8 is compressed-tensors "float-quantized" (the same tensors with e4m3 codes; model_zoo/quant/fp8_format.py,
which also reads AutoFP8's quant_method "fp8"); compressed-tensors configs are parsed in ct_config.py.
AWQ W4A16 is AutoAWQ's GEMM layout: `{m}.qweight` int32 [K, N/8], `{m}.qzeros` int32 [K/G, N/8],
`{m}.scales` fp16 [K/G, N]. GPTQ int4 (model_zoo/quant/gptq.py) is read onto the AWQ layout, so it is the AWQ
scheme to the engine. The config.json `quantization_config` says which; the file name never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.linear import Linear
from model_zoo.quant.ct_config import (CtLayout, NumType, check_positive, ct_quantization_config, dense_linear,
                                       get_tensor, parse_ct_layout, static_input_scale, zero_point_is_zero)
from model_zoo.quant.fp8_format import (FP8_METHOD, describe_fp8, export_tensors_fp8, fp8_factory,
                                        fp8_quantization_config, parse_native_fp8)
from model_zoo.quant.gptq import describe_gptq, gptq_linear, parse_gptq_layout
from model_zoo.quant.int8 import QMAX, ActQuant
from model_zoo.quant.linear import AwqLinear, Fp8Linear, Int8Linear
from model_zoo.weights import LinearFactory, ModelWeights, dense_factory

AWQ_VERSION = "gemm"
__all__ = ["Scheme", "scheme_of", "describe_quantization", "linear_factory_for", "load_quantized_weights",
           "int8_quantization_config", "fp8_quantization_config", "awq_quantization_config", "export_tensors_int8",
           "export_tensors_fp8", "export_tensors_awq", "export_tensors_linear", "amax_as_stored", "parse_int8_layout"]


class Scheme(str, Enum):
    FP16 = "fp16"
    INT8 = "int8"
    FP8 = "fp8"
    AWQ = "awq"


@dataclass(frozen=True)
class AwqLayout:
    group_size: int
    not_converted: tuple[str, ...]  # AutoAWQ keeps a module dense when one of these is a substring of its name

    def quantized(self, module: str) -> bool:
        return not any(key in module for key in self.not_converted)


def scheme_of(quantization_config: Mapping[str, Any] | None) -> Scheme:
    """The scheme a config.json `quantization_config` describes; refuses layouts fllama cannot run."""
    if not quantization_config:
        return Scheme.FP16
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        layout = parse_ct_layout(quantization_config)
        return Scheme.FP8 if layout.num_type is NumType.FLOAT else Scheme.INT8
    if method == FP8_METHOD:
        parse_native_fp8(quantization_config)
        return Scheme.FP8
    if method == "awq":
        parse_awq_layout(quantization_config)
        return Scheme.AWQ
    if method == "gptq":
        parse_gptq_layout(quantization_config)
        return Scheme.AWQ  # the same int4 groups, re-packed at load
    raise ModelSourceError(f"unsupported quantization method {method or '(none)'!r}; fllama runs fp16, "
                           "compressed-tensors int8 and fp8 (W8A8), AutoFP8, AWQ GEMM and GPTQ int4 checkpoints")


def describe_quantization(quantization_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A short summary for `fllama info`: scheme, activation mode(s) or group size."""
    scheme = scheme_of(quantization_config)
    if scheme is Scheme.INT8:
        layout = parse_int8_layout(quantization_config)
        return {"scheme": scheme.value, "act": sorted({g.act.value for g in layout.groups})}
    if scheme is Scheme.FP8:
        return {"scheme": scheme.value, **describe_fp8(quantization_config)}
    if scheme is Scheme.AWQ and _is_gptq(quantization_config):
        return {"scheme": scheme.value, **describe_gptq(parse_gptq_layout(quantization_config))}
    if scheme is Scheme.AWQ:
        return {"scheme": scheme.value, "group_size": parse_awq_layout(quantization_config).group_size}
    return {"scheme": scheme.value}


def _is_gptq(qc: Mapping[str, Any] | None) -> bool:
    return bool(qc) and str(qc.get("quant_method", "")).lower() == "gptq"


def parse_int8_layout(qc: Mapping[str, Any]) -> CtLayout:
    """compressed-tensors config -> its layout, refused unless it is int8 W8A8."""
    layout = parse_ct_layout(qc)
    if layout.num_type is not NumType.INT:
        raise ModelSourceError("this compressed-tensors checkpoint holds fp8 weights, not int8")
    return layout


def parse_awq_layout(qc: Mapping[str, Any]) -> AwqLayout:
    """AutoAWQ config -> AwqLayout; refuses every packing but GEMM (TinyChat, GEMV, exllama, marlin...)."""
    version = str(qc.get("version", AWQ_VERSION)).lower()
    if version != AWQ_VERSION:
        raise ModelSourceError(f"AWQ version {version!r} is not supported: fllama reads only AutoAWQ's GEMM "
                               "layout (qweight [K, N/8]); re-export the model with version 'gemm'")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelSourceError(f"AWQ with {bits} bits is not supported; fllama reads 4-bit AWQ")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ModelSourceError(f"AWQ group_size {group_size!r} is not supported; fllama needs a positive group size")
    if not qc.get("zero_point", True):
        raise ModelSourceError("AWQ without zero points is not supported; fllama reads zero_point: true")
    not_converted = qc.get("modules_to_not_convert") or []
    return AwqLayout(group_size=group_size, not_converted=tuple(map(str, not_converted)))


def linear_factory_for(scheme: Scheme, quantization_config: Mapping[str, Any] | None) -> LinearFactory:
    """The (prefix, state_dict) -> Linear callable that ModelWeights.from_state_dict takes for this scheme."""
    scheme = Scheme(scheme)
    if scheme is Scheme.FP16:
        return dense_factory
    if scheme is Scheme.INT8:
        layout = parse_int8_layout(quantization_config)
        return lambda prefix, sd: _int8_linear(prefix, sd, layout.act_for(prefix))
    if scheme is Scheme.FP8:
        return fp8_factory(quantization_config)
    if _is_gptq(quantization_config):  # modules stored without a qweight were left dense by the quantizer
        gptq = parse_gptq_layout(quantization_config)
        return lambda prefix, sd: gptq_linear(prefix, sd, gptq) if prefix + ".qweight" in sd else dense_linear(prefix, sd)
    awq = parse_awq_layout(quantization_config)
    return lambda prefix, sd: _awq_linear(prefix, sd, awq.group_size) if awq.quantized(prefix) else dense_linear(prefix, sd)


def _int8_linear(prefix: str, sd: Mapping[str, torch.Tensor], act: ActQuant | None) -> Linear:
    if act is None:
        return dense_linear(prefix, sd)
    weight, scale = get_tensor(sd, prefix + ".weight"), get_tensor(sd, prefix + ".weight_scale")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise CorruptCheckpointError(f"{prefix}.weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    if not scale.is_floating_point() or tuple(scale.shape) not in ((n, 1), (n,)):
        raise CorruptCheckpointError(f"{prefix}.weight_scale must be a float [{n}, 1] for weight "
                                     f"{tuple(weight.shape)}, got {scale.dtype} {tuple(scale.shape)}")
    check_positive(prefix + ".weight_scale", scale)
    zero_point_is_zero(prefix, sd)
    a_amax = None
    if act is ActQuant.STATIC:
        a_amax = float(static_input_scale(prefix, sd) * QMAX)  # amax in fp32, fllama's static parameter
    return Int8Linear(weight, scale.float().reshape(n), act, a_amax, dtype=scale.dtype)


def _awq_linear(prefix: str, sd: Mapping[str, torch.Tensor], group_size: int) -> Linear:
    qweight, qzeros, scales = (get_tensor(sd, f"{prefix}.{name}") for name in ("qweight", "qzeros", "scales"))
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or not scales.is_floating_point():
        raise CorruptCheckpointError(f"{prefix}: AWQ needs int32 qweight/qzeros and float scales, got "
                                     f"{qweight.dtype}, {qzeros.dtype}, {scales.dtype}")
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise CorruptCheckpointError(f"{prefix}: AWQ tensors must be 2-D")
    k, words = qweight.shape
    n = 8 * words
    if k % group_size:
        raise CorruptCheckpointError(f"{prefix}: group_size {group_size} from the config does not divide the "
                                     f"input size {k} of qweight {tuple(qweight.shape)}")
    want = {"qzeros": ((k // group_size, words), qzeros), "scales": ((k // group_size, n), scales)}
    for name, (shape, t) in want.items():
        if tuple(t.shape) != shape:
            raise CorruptCheckpointError(f"{prefix}.{name} has shape {tuple(t.shape)} but qweight "
                                         f"{tuple(qweight.shape)} with group size {group_size} needs {shape}")
    return AwqLinear(qweight, qzeros, scales, group_size, dtype=scales.dtype)


# --- writing -------------------------------------------------------------------------------------------------

def int8_quantization_config(static: bool, ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """compressed-tensors int-quantized W8A8: per-channel weights; per-token dynamic or per-tensor static inputs."""
    return ct_quantization_config(NumType.INT, static, "channel", ignore)


def awq_quantization_config(group_size: int, zero_point: bool = True) -> dict[str, Any]:
    """AutoAWQ GEMM; all four of quant_method/bits/group_size/zero_point so vLLM can pick AWQ-Marlin."""
    layout = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point,
              "version": AWQ_VERSION, "modules_to_not_convert": None}
    parse_awq_layout(layout)  # refuses what fllama itself could not read back
    return layout


def export_tensors_int8(prefix: str, qweight: torch.Tensor, w_scale: torch.Tensor, a_amax: float | None = None,
                        dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """compressed-tensors tensors of one Linear; scales in the model dtype, input_scale = amax / 127."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or w_scale.numel() != qweight.shape[0]:
        raise CorruptCheckpointError(f"{prefix}: need int8 [N, K] codes and N scales, got {qweight.dtype} "
                                     f"{tuple(qweight.shape)} and {w_scale.numel()} scales")
    n = qweight.shape[0]
    out = {f"{prefix}.weight": qweight.contiguous(),
           f"{prefix}.weight_scale": w_scale.float().reshape(n, 1).to(dtype)}  # [N, 1]
    if a_amax is not None:
        a_scale = torch.tensor([a_amax], dtype=torch.float32) / QMAX  # [1], the same fp32 op as the kernels
        out[f"{prefix}.input_scale"] = a_scale.to(dtype)
    for name, t in out.items():
        if t.is_floating_point():
            check_positive(name, t)  # e.g. an fp16 scale that underflowed
    return out


def amax_as_stored(a_amax: float, dtype: torch.dtype = torch.float16) -> float:
    """The static amax a reader gets back from input_scale written in `dtype` (use it in memory too, so the
    exported checkpoint and the model that was evaluated before export compute the same numbers)."""
    input_scale = (torch.tensor(a_amax, dtype=torch.float32) / QMAX).to(dtype)
    return float(input_scale.float() * QMAX)


def export_tensors_awq(prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor,
                       scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors of one Linear (scales written in fp16, as AutoAWQ and vLLM expect)."""
    if qweight.dim() != 2 or qzeros.dim() != 2 or qzeros.shape[0] == 0 or qweight.shape[0] % qzeros.shape[0]:
        raise CorruptCheckpointError(f"{prefix}: qweight {tuple(qweight.shape)} and qzeros {tuple(qzeros.shape)} "
                                     "do not form whole groups")
    out = {f"{prefix}.qweight": qweight.contiguous(), f"{prefix}.qzeros": qzeros.contiguous(),
           f"{prefix}.scales": scales.to(torch.float16).contiguous()}
    _awq_linear(prefix, out, qweight.shape[0] // qzeros.shape[0])  # the same checks a reader applies
    return out


def export_tensors_linear(prefix: str, lin: Linear, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of any fllama Linear: quantized ones in their format, dense ones as `weight`."""
    if isinstance(lin, Int8Linear):
        return export_tensors_int8(prefix, lin.qweight, lin.w_scale, lin.a_amax, dtype)
    if isinstance(lin, Fp8Linear):  # scales stay fp32 whatever the model dtype: the numbers evaluated are kept
        return export_tensors_fp8(prefix, lin.weight8, lin.w_scale, lin.a_scale)
    if isinstance(lin, AwqLinear):
        return export_tensors_awq(prefix, lin.qweight, lin.qzeros, lin.scales)
    return {f"{prefix}.weight": lin.dense_weight().to(dtype).contiguous()}


def load_quantized_weights(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor],
                           quantization_config: Mapping[str, Any] | None, dtype: torch.dtype) -> ModelWeights:
    """ModelWeights with the Linear kind the config names; float tensors (embeddings, norms) in `dtype`."""
    scheme = scheme_of(quantization_config)
    factory = linear_factory_for(scheme, quantization_config)
    meta = {"scheme": scheme.value, "quantization_config": dict(quantization_config or {})}
    for name, t in state_dict.items():  # embeddings, norms and lm_head have no scales to read fp8 codes with
        if "_proj." not in name and t.is_floating_point() and t.element_size() == 1:
            raise CorruptCheckpointError(f"{name} is stored as {t.dtype}; fllama reads fp8 codes only in the "
                                         "decoder's linears (embeddings, norms and lm_head stay wide)")
    weights = ModelWeights.from_state_dict(config, state_dict, factory, meta=meta)
    for layer in weights.layers:
        for group in (("wq", "wk", "wv"), ("w_gate", "w_up")):
            _share_static_amax(layer, group)
            _share_static_fp8(layer, group)
    return weights.to(dtype=dtype)


def _share_static_amax(layer: Any, attrs: tuple[str, ...]) -> None:
    """Linears that read the same input run as one fused GEMM, so they need one activation scale; like vLLM,
    take the largest. fllama's exports already store one value per capture point."""
    lins = [getattr(layer, a) for a in attrs]
    if all(isinstance(lin, Int8Linear) and lin.act is ActQuant.STATIC for lin in lins):
        shared = max(lin.a_amax for lin in lins)
        for lin in lins:
            lin.a_amax = shared


def _share_static_fp8(layer: Any, attrs: tuple[str, ...]) -> None:
    """The fp8 form of _share_static_amax: one input scale per fused GEMM, the largest (vLLM's choice)."""
    lins = [getattr(layer, a) for a in attrs]
    if all(isinstance(lin, Fp8Linear) and lin.act is ActQuant.STATIC for lin in lins):
        shared = max(lin.a_scale for lin in lins)
        for lin in lins:
            lin.a_scale = shared
