"""Quantized checkpoint layouts that other engines load (REFERENCE.md section 2), read and written.

INT8 W8A8 is compressed-tensors "int-quantized" (vLLM, transformers): `{m}.weight` int8 [N, K],
`{m}.weight_scale` [N, 1] with W ~ weight * weight_scale, and for static activations `{m}.input_scale` [1].
AWQ W4A16 is AutoAWQ's GEMM layout: `{m}.qweight` int32 [K, N/8], `{m}.qzeros` int32 [K/G, N/8],
`{m}.scales` fp16 [K/G, N]. GPTQ int4 (model_zoo/quant/gptq.py) is read onto the AWQ layout, so it is the AWQ
scheme to the engine. The config.json `quantization_config` says which; the file name never does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.linear import DenseLinear, Linear
from model_zoo.quant.gptq import describe_gptq, gptq_linear, parse_gptq_layout
from model_zoo.quant.int8 import QMAX, ActQuant
from model_zoo.quant.linear import AwqLinear, Int8Linear
from model_zoo.weights import LinearFactory, ModelWeights, dense_factory

INT8_FORMATS = ("int-quantized", "naive-quantized")  # the same storage for 8-bit int weights
AWQ_VERSION = "gemm"


class Scheme(str, Enum):
    FP16 = "fp16"
    INT8 = "int8"
    AWQ = "awq"


@dataclass(frozen=True)
class Int8Group:
    targets: tuple[str, ...]  # "Linear", module names, or "re:<regex>" (compressed-tensors' matching)
    act: ActQuant


@dataclass(frozen=True)
class Int8Layout:
    groups: tuple[Int8Group, ...]
    ignore: tuple[str, ...]

    def act_for(self, module: str) -> ActQuant | None:
        """The activation mode of `module`, or None when it stays dense."""
        if any(_ct_match(module, t) for t in self.ignore):
            return None
        for g in self.groups:
            if any(_ct_match(module, t) for t in g.targets):
                return g.act
        return None


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
        parse_int8_layout(quantization_config)
        return Scheme.INT8
    if method == "awq":
        parse_awq_layout(quantization_config)
        return Scheme.AWQ
    if method == "gptq":
        parse_gptq_layout(quantization_config)
        return Scheme.AWQ  # the same int4 groups, re-packed at load
    raise ModelSourceError(f"unsupported quantization method {method or '(none)'!r}; fllama runs fp16, "
                           "compressed-tensors int8 (W8A8), AWQ GEMM and GPTQ int4 checkpoints")


def describe_quantization(quantization_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A short summary for `fllama info`: scheme, activation mode(s) or group size."""
    scheme = scheme_of(quantization_config)
    if scheme is Scheme.INT8:
        layout = parse_int8_layout(quantization_config)
        return {"scheme": scheme.value, "act": sorted({g.act.value for g in layout.groups})}
    if scheme is Scheme.AWQ and _is_gptq(quantization_config):
        return {"scheme": scheme.value, **describe_gptq(parse_gptq_layout(quantization_config))}
    if scheme is Scheme.AWQ:
        return {"scheme": scheme.value, "group_size": parse_awq_layout(quantization_config).group_size}
    return {"scheme": scheme.value}


def _is_gptq(qc: Mapping[str, Any] | None) -> bool:
    return bool(qc) and str(qc.get("quant_method", "")).lower() == "gptq"


def parse_int8_layout(qc: Mapping[str, Any]) -> Int8Layout:
    """compressed-tensors config -> Int8Layout; only symmetric per-channel int8 weights with int8 inputs."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelSourceError(f"compressed-tensors checkpoint with quantization_status {status!r}: "
                               "fllama reads only compressed (int8-stored) weights")
    if qc.get("kv_cache_scheme"):
        raise ModelSourceError("compressed-tensors kv_cache_scheme (quantized KV cache) is not supported")
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, Mapping) or not groups_cfg:
        raise CorruptCheckpointError("compressed-tensors quantization_config has no config_groups")
    groups = tuple(_parse_int8_group(name, g, qc.get("format")) for name, g in groups_cfg.items())
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list):
        raise CorruptCheckpointError(f"compressed-tensors 'ignore' must be a list, got {ignore!r}")
    return Int8Layout(groups=groups, ignore=tuple(map(str, ignore)))


def _parse_int8_group(name: str, g: Any, top_format: Any) -> Int8Group:
    if not isinstance(g, Mapping):
        raise CorruptCheckpointError(f"compressed-tensors config group {name!r} is not an object")
    fmt = g.get("format") or top_format
    if fmt not in INT8_FORMATS:
        raise ModelSourceError(f"compressed-tensors format {fmt!r} (group {name!r}) is not supported; "
                               f"fllama reads {' / '.join(INT8_FORMATS)} int8 W8A8")
    w, a = g.get("weights"), g.get("input_activations")
    if not isinstance(w, Mapping) or not _is_sym_int8(w) or w.get("strategy") != "channel" or w.get("dynamic"):
        raise ModelSourceError(f"group {name!r}: fllama needs symmetric int8 weights with one scale per output "
                               f"channel, got {dict(w) if isinstance(w, Mapping) else w}")
    if g.get("output_activations"):
        raise ModelSourceError(f"group {name!r}: output activation quantization is not supported")
    if not isinstance(a, Mapping) or not _is_sym_int8(a):
        raise ModelSourceError(f"group {name!r}: fllama needs symmetric int8 input activations (W8A8), "
                               f"got {dict(a) if isinstance(a, Mapping) else a}")
    strategy, dynamic = a.get("strategy", "tensor"), bool(a.get("dynamic", False))
    if (strategy, dynamic) == ("token", True):
        act = ActQuant.DYNAMIC
    elif (strategy, dynamic) == ("tensor", False):
        act = ActQuant.STATIC
    else:
        raise ModelSourceError(f"group {name!r}: input activations with strategy {strategy!r} and dynamic "
                               f"{dynamic} are not supported (token+dynamic or tensor+static)")
    targets = g.get("targets")
    if not isinstance(targets, list) or not targets:
        raise CorruptCheckpointError(f"compressed-tensors config group {name!r} has no targets")
    return Int8Group(targets=tuple(map(str, targets)), act=act)


def _is_sym_int8(args: Mapping[str, Any]) -> bool:
    return (args.get("num_bits", 8) == 8 and args.get("type", "int") == "int" and args.get("symmetric", True)
            and args.get("group_size") is None)


def _ct_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target  # every module fllama asks about is a Linear


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
    if _is_gptq(quantization_config):  # modules stored without a qweight were left dense by the quantizer
        gptq = parse_gptq_layout(quantization_config)
        return lambda prefix, sd: gptq_linear(prefix, sd, gptq) if prefix + ".qweight" in sd else _dense(prefix, sd)
    awq = parse_awq_layout(quantization_config)
    return lambda prefix, sd: _awq_linear(prefix, sd, awq.group_size) if awq.quantized(prefix) else _dense(prefix, sd)


def _int8_linear(prefix: str, sd: Mapping[str, torch.Tensor], act: ActQuant | None) -> Linear:
    if act is None:
        return _dense(prefix, sd)
    weight, scale = _get(sd, prefix + ".weight"), _get(sd, prefix + ".weight_scale")
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise CorruptCheckpointError(f"{prefix}.weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    if not scale.is_floating_point() or tuple(scale.shape) not in ((n, 1), (n,)):
        raise CorruptCheckpointError(f"{prefix}.weight_scale must be a float [{n}, 1] for weight "
                                     f"{tuple(weight.shape)}, got {scale.dtype} {tuple(scale.shape)}")
    _check_positive(prefix + ".weight_scale", scale)
    zp = sd.get(prefix + ".weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        raise CorruptCheckpointError(f"{prefix}.weight_zero_point is not zero in a symmetric int8 checkpoint")
    a_amax = None
    if act is ActQuant.STATIC:
        input_scale = _get(sd, prefix + ".input_scale")
        if not input_scale.is_floating_point() or input_scale.numel() != 1:
            raise CorruptCheckpointError(f"{prefix}.input_scale must be one float (per-tensor static), "
                                         f"got {input_scale.dtype} {tuple(input_scale.shape)}")
        _check_positive(prefix + ".input_scale", input_scale)
        a_amax = float(input_scale.float().reshape(()) * QMAX)  # amax in fp32, fllama's static parameter
    return Int8Linear(weight, scale.float().reshape(n), act, a_amax, dtype=scale.dtype)


def _awq_linear(prefix: str, sd: Mapping[str, torch.Tensor], group_size: int) -> Linear:
    qweight, qzeros, scales = (_get(sd, f"{prefix}.{name}") for name in ("qweight", "qzeros", "scales"))
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


def _dense(prefix: str, sd: Mapping[str, torch.Tensor]) -> Linear:
    w = _get(sd, prefix + ".weight")
    if not w.is_floating_point():
        raise CorruptCheckpointError(f"{prefix}.weight is {w.dtype} but the quantization_config leaves it unquantized")
    return DenseLinear(w)


def _check_positive(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise CorruptCheckpointError(f"{name} holds non-positive or non-finite scales")


def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise CorruptCheckpointError(f"checkpoint lacks the tensor {name!r}") from None


# --- writing -------------------------------------------------------------------------------------------------

def int8_quantization_config(static: bool, ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """compressed-tensors int-quantized W8A8: per-channel weights; per-token dynamic or per-tensor static inputs."""
    act = ({"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True})
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**int8, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**int8, **act}}},
    }


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
            _check_positive(name, t)  # e.g. an fp16 scale that underflowed
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
    if isinstance(lin, AwqLinear):
        return export_tensors_awq(prefix, lin.qweight, lin.qzeros, lin.scales)
    return {f"{prefix}.weight": lin.dense_weight().to(dtype).contiguous()}


def load_quantized_weights(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor],
                           quantization_config: Mapping[str, Any] | None, dtype: torch.dtype) -> ModelWeights:
    """ModelWeights with the Linear kind the config names; float tensors (embeddings, norms) in `dtype`."""
    scheme = scheme_of(quantization_config)
    factory = linear_factory_for(scheme, quantization_config)
    meta = {"scheme": scheme.value, "quantization_config": dict(quantization_config or {})}
    weights = ModelWeights.from_state_dict(config, state_dict, factory, meta=meta)
    for layer in weights.layers:
        _share_static_amax(layer, ("wq", "wk", "wv"))
        _share_static_amax(layer, ("w_gate", "w_up"))
    return weights.to(dtype=dtype)


def _share_static_amax(layer: Any, attrs: tuple[str, ...]) -> None:
    """Linears that read the same input run as one fused GEMM, so they need one activation scale; like vLLM,
    take the largest. fllama's exports already store one value per capture point."""
    lins = [getattr(layer, a) for a in attrs]
    if all(isinstance(lin, Int8Linear) and lin.act is ActQuant.STATIC for lin in lins):
        shared = max(lin.a_amax for lin in lins)
        for lin in lins:
            lin.a_amax = shared
