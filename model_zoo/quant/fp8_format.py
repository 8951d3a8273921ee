"""FP8 E4M3 W8A8 checkpoints, read and written.

fllama writes compressed-tensors `float-quantized` (vLLM, transformers): per Linear K -> N, `{m}.weight`
float8_e4m3fn [N, K], `{m}.weight_scale` fp32 [N, 1] (W ~ weight * weight_scale), and for static activations
`{m}.input_scale` fp32 [1] (x ~ x8 * input_scale). It reads those with per-channel or per-tensor weight scales
(llm-compressor's FP8_DYNAMIC and FP8 presets), and the `quant_method: "fp8"` layout of AutoFP8 / vLLM
(per-tensor weight scales, `activation_scheme` dynamic or static, `ignored_layers`). Block-wise fp8 (DeepSeek's
`weight_block_size`, compressed-tensors strategy "block") is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.linear import Linear
from model_zoo.quant.ct_config import (CtLayout, NumType, check_positive, ct_quantization_config, dense_linear,
                                       get_tensor, parse_ct_layout, static_input_scale, zero_point_is_zero)
from model_zoo.quant.fp8 import FP8_DTYPE
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear

FP8_METHOD = "fp8"  # AutoFP8 / vLLM's own quant_method


@dataclass(frozen=True)
class NativeFp8Layout:
    """quant_method "fp8": one activation scheme for every quantized linear; `ignored` stay dense."""

    act: ActQuant
    ignored: tuple[str, ...]

    def act_for(self, module: str) -> ActQuant | None:
        # vLLM matches full names; a suffix ("lm_head", "mlp.down_proj") matches every module that ends so
        return None if any(module == i or module.endswith("." + i) for i in self.ignored) else self.act


def parse_native_fp8(qc: Mapping[str, Any]) -> NativeFp8Layout:
    """AutoFP8 / vLLM `quant_method: "fp8"` -> NativeFp8Layout."""
    if qc.get("weight_block_size"):
        raise ModelSourceError(f"block-wise fp8 (weight_block_size {qc['weight_block_size']}) is not supported; "
                               "fllama reads fp8 with per-channel or per-tensor weight scales")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelSourceError(f"fp8 format {fmt!r} is not supported; fllama reads e4m3 weights")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    acts = {"dynamic": ActQuant.DYNAMIC, "static": ActQuant.STATIC}
    if scheme not in acts:
        raise ModelSourceError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic or static)")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if not isinstance(ignored, list):
        raise CorruptCheckpointError(f"fp8 ignored_layers must be a list, got {ignored!r}")
    return NativeFp8Layout(act=acts[scheme], ignored=tuple(map(str, ignored)))


def is_native_fp8(qc: Mapping[str, Any] | None) -> bool:
    return bool(qc) and str(qc.get("quant_method", "")).lower() == FP8_METHOD


def fp8_layout(qc: Mapping[str, Any]) -> CtLayout | NativeFp8Layout:
    """Either layout an fp8 checkpoint may have; both answer act_for(module)."""
    return parse_native_fp8(qc) if is_native_fp8(qc) else parse_ct_layout(qc)


def describe_fp8(qc: Mapping[str, Any]) -> dict[str, Any]:
    """For `fllama info`: activation mode(s), weight scale granularity, the stored layout."""
    layout = fp8_layout(qc)
    if isinstance(layout, NativeFp8Layout):
        return {"act": [layout.act.value], "weight_scales": ["tensor"], "format": "fp8 (AutoFP8 / vLLM)"}
    return {"act": sorted({g.act.value for g in layout.groups}),
            "weight_scales": sorted({g.weight_strategy for g in layout.groups}),
            "format": "compressed-tensors float-quantized"}


def fp8_factory(qc: Mapping[str, Any]):
    """The (prefix, state_dict) -> Linear callable for an fp8 checkpoint."""
    layout = fp8_layout(qc)
    return lambda prefix, sd: fp8_linear(prefix, sd, layout.act_for(prefix))


def fp8_linear(prefix: str, sd: Mapping[str, torch.Tensor], act: ActQuant | None) -> Linear:
    """One stored fp8 Linear -> Fp8Linear (scales in fp32); a module the layout leaves dense -> DenseLinear."""
    if act is None:
        return dense_linear(prefix, sd)
    weight = get_tensor(sd, prefix + ".weight")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise CorruptCheckpointError(f"{prefix}.weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                                     f"{tuple(weight.shape)}")
    n = weight.shape[0]
    scale = sd.get(prefix + ".weight_scale")
    if scale is None and prefix + ".weight_scale_inv" in sd:
        raise ModelSourceError(f"{prefix}.weight_scale_inv: block-wise fp8 is not supported; fllama reads fp8 with "
                               "per-channel or per-tensor weight scales")
    scale = get_tensor(sd, prefix + ".weight_scale")
    if not scale.is_floating_point() or scale.element_size() == 1 or scale.numel() not in (1, n) \
            or (scale.numel() == n and tuple(scale.shape) not in ((n, 1), (n,))):
        raise CorruptCheckpointError(f"{prefix}.weight_scale must be a float [{n}, 1] or one float for weight "
                                     f"{tuple(weight.shape)}, got {scale.dtype} {tuple(scale.shape)}")
    check_positive(prefix + ".weight_scale", scale)
    zero_point_is_zero(prefix, sd)
    a_scale = None
    if act is ActQuant.STATIC:
        a_scale = float(static_input_scale(prefix, sd))
    dtype = scale.dtype if scale.dtype in (torch.float16, torch.bfloat16) else torch.float16
    return Fp8Linear(weight, scale.float().reshape(-1), act, a_scale, dtype=dtype)


def fp8_quantization_config(static: bool, ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """compressed-tensors float-quantized W8A8: e4m3 weights per output channel; e4m3 inputs per token dynamic
    or per tensor static."""
    return ct_quantization_config(NumType.FLOAT, static, "channel", ignore)


def export_tensors_fp8(prefix: str, weight8: torch.Tensor, w_scale: torch.Tensor,
                       a_scale: float | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors tensors of one fp8 Linear: e4m3 codes, fp32 weight_scale [N, 1], input_scale [1]."""
    if weight8.dtype != FP8_DTYPE or weight8.dim() != 2 or w_scale.numel() != weight8.shape[0]:
        raise CorruptCheckpointError(f"{prefix}: need float8_e4m3fn [N, K] codes and N scales, got {weight8.dtype} "
                                     f"{tuple(weight8.shape)} and {w_scale.numel()} scales")
    n = weight8.shape[0]
    out = {f"{prefix}.weight": weight8.contiguous(),
           f"{prefix}.weight_scale": w_scale.float().reshape(n, 1).contiguous()}  # [N, 1]
    if a_scale is not None:
        out[f"{prefix}.input_scale"] = torch.tensor([a_scale], dtype=torch.float32)  # [1]
    for name, t in out.items():
        if t.dtype == torch.float32:
            check_positive(name, t)
    return out
