"""compressed-tensors `quantization_config`: its W8A8 groups (int8 or fp8 e4m3) read into a CtLayout, and the
checks every stored tensor goes through.

A config has `config_groups` (each: `targets`, `weights` and `input_activations` argument sets, optionally its
own `format`), an `ignore` list and a `format` (int-quantized, float-quantized or naive-quantized). Targets and
ignore entries are module names, class names ("Linear") or "re:<regex>" patterns, matched as compressed-tensors
matches them. fllama runs symmetric 8-bit W8A8 only: int weights per output channel, float (e4m3) weights per
output channel or per tensor, inputs per token dynamic or per tensor static, all groups of one number type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

import torch

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.linear import DenseLinear, Linear
from model_zoo.quant.int8 import ActQuant
from model_zoo.weights import get_tensor


class NumType(str, Enum):
    """compressed-tensors' `type` of a quantization argument set."""

    INT = "int"
    FLOAT = "float"


# The storage formats of 8-bit weights of each type ("naive-quantized" stores either as its own dtype).
FORMATS = {NumType.INT: ("int-quantized", "naive-quantized"), NumType.FLOAT: ("float-quantized", "naive-quantized")}
WEIGHT_STRATEGIES = {NumType.INT: ("channel",), NumType.FLOAT: ("channel", "tensor")}


@dataclass(frozen=True)
class CtGroup:
    targets: tuple[str, ...]  # "Linear", module names, or "re:<regex>" (compressed-tensors' matching)
    act: ActQuant
    weight_strategy: str = "channel"  # "channel": weight_scale [N, 1]; "tensor": one scale (fp8 only)


@dataclass(frozen=True)
class CtLayout:
    num_type: NumType
    groups: tuple[CtGroup, ...]
    ignore: tuple[str, ...]

    def group_for(self, module: str) -> CtGroup | None:
        """The group that quantizes `module`, or None when it stays dense."""
        if any(ct_match(module, t) for t in self.ignore):
            return None
        for g in self.groups:
            if any(ct_match(module, t) for t in g.targets):
                return g
        return None

    def act_for(self, module: str) -> ActQuant | None:
        """The activation mode of `module`, or None when it stays dense."""
        g = self.group_for(module)
        return None if g is None else g.act


def ct_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or module == target  # every module fllama asks about is a Linear


def parse_ct_layout(qc: Mapping[str, Any]) -> CtLayout:
    """compressed-tensors config -> CtLayout; refuses, in one line, every layout fllama cannot run."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelSourceError(f"compressed-tensors checkpoint with quantization_status {status!r}: "
                               "fllama reads only compressed (int8- or fp8-stored) weights")
    if qc.get("kv_cache_scheme"):
        raise ModelSourceError("compressed-tensors kv_cache_scheme (quantized KV cache) is not supported")
    for key, what in (("sparsity_config", "sparse weights"), ("transform_config", "rotated (transformed) weights")):
        if qc.get(key):  # the writer stores these as {} when unused
            raise ModelSourceError(f"compressed-tensors {key} ({what}) is not supported; fllama reads plain W8A8")
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, Mapping) or not groups_cfg:
        raise CorruptCheckpointError("compressed-tensors quantization_config has no config_groups")
    parsed = [_parse_group(name, g, qc.get("format")) for name, g in groups_cfg.items()]
    types = {t for t, _ in parsed}
    if len(types) > 1:
        raise ModelSourceError("compressed-tensors checkpoint mixes int and float groups; fllama runs one "
                               "W8A8 type per model")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list):
        raise CorruptCheckpointError(f"compressed-tensors 'ignore' must be a list, got {ignore!r}")
    return CtLayout(num_type=types.pop(), groups=tuple(g for _, g in parsed), ignore=tuple(map(str, ignore)))


def _parse_group(name: str, g: Any, top_format: Any) -> tuple[NumType, CtGroup]:
    if not isinstance(g, Mapping):
        raise CorruptCheckpointError(f"compressed-tensors config group {name!r} is not an object")
    w, a = g.get("weights"), g.get("input_activations")
    num_type = _num_type(w)
    fmt = g.get("format") or top_format
    if num_type is None or fmt not in FORMATS[num_type]:
        known = " / ".join(f"{f} ({t.value})" for t in NumType for f in FORMATS[t][:1])
        raise ModelSourceError(f"compressed-tensors format {fmt!r} with {_args_text(w)} weights (group {name!r}) "
                               f"is not supported; fllama reads {known} 8-bit W8A8")
    strategy = w.get("strategy", "tensor")
    if (not _is_sym8(w, num_type) or strategy not in WEIGHT_STRATEGIES[num_type] or w.get("dynamic")):
        per = " or per tensor" if num_type is NumType.FLOAT else ""
        raise ModelSourceError(f"group {name!r}: fllama needs symmetric 8-bit {num_type.value} weights with one "
                               f"scale per output channel{per}, got {_args_text(w)}")
    if g.get("output_activations"):
        raise ModelSourceError(f"group {name!r}: output activation quantization is not supported")
    if not isinstance(a, Mapping) or not _is_sym8(a, num_type):
        raise ModelSourceError(f"group {name!r}: fllama needs symmetric 8-bit {num_type.value} input activations "
                               f"(W8A8), got {_args_text(a)}")
    act = _act_mode(name, a)
    targets = g.get("targets")
    if not isinstance(targets, list) or not targets:
        raise CorruptCheckpointError(f"compressed-tensors config group {name!r} has no targets")
    return num_type, CtGroup(targets=tuple(map(str, targets)), act=act, weight_strategy=strategy)


def _num_type(w: Any) -> NumType | None:
    if not isinstance(w, Mapping):
        return None
    try:
        return NumType(str(w.get("type", "int")))
    except ValueError:
        return None


def _act_mode(name: str, a: Mapping[str, Any]) -> ActQuant:
    strategy, dynamic = a.get("strategy", "tensor"), bool(a.get("dynamic", False))
    if (strategy, dynamic) == ("token", True):
        return ActQuant.DYNAMIC
    if (strategy, dynamic) == ("tensor", False):
        return ActQuant.STATIC
    raise ModelSourceError(f"group {name!r}: input activations with strategy {strategy!r} and dynamic "
                           f"{dynamic} are not supported (token+dynamic or tensor+static)")


def _is_sym8(args: Mapping[str, Any], num_type: NumType) -> bool:
    return (args.get("num_bits", 8) == 8 and args.get("type", "int") == num_type.value
            and args.get("symmetric", True) and args.get("group_size") is None
            and not args.get("block_structure"))


def _args_text(args: Any) -> str:
    return str(dict(args)) if isinstance(args, Mapping) else str(args)


def ct_quantization_config(num_type: NumType, static: bool, weight_strategy: str = "channel",
                           ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """compressed-tensors W8A8, as vLLM and transformers read it: symmetric 8-bit weights (per output channel),
    inputs per token dynamic or per tensor static, one group targeting every Linear but `ignore`."""
    act = ({"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True})
    args = {"num_bits": 8, "type": num_type.value, "symmetric": True}
    cfg = {
        "quant_method": "compressed-tensors",
        "format": FORMATS[num_type][0],
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**args, "strategy": weight_strategy, "dynamic": False},
                                      "input_activations": {**args, **act}}},
    }
    parse_ct_layout(cfg)  # refuses what fllama itself could not read back
    return cfg


# --- the checks every stored tensor goes through ----------------------------------------------------------------

def check_positive(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t.float()).all()) or bool((t.float() <= 0).any()):
        raise CorruptCheckpointError(f"{name} holds non-positive or non-finite scales")


def static_input_scale(prefix: str, sd: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A static layer's per-tensor input_scale, checked (one positive finite float), as an fp32 scalar."""
    input_scale = get_tensor(sd, prefix + ".input_scale")
    if not input_scale.is_floating_point() or input_scale.numel() != 1:
        raise CorruptCheckpointError(f"{prefix}.input_scale must be one float (per-tensor static), "
                                     f"got {input_scale.dtype} {tuple(input_scale.shape)}")
    check_positive(prefix + ".input_scale", input_scale)
    return input_scale.float().reshape(())


def dense_linear(prefix: str, sd: Mapping[str, torch.Tensor]) -> Linear:
    """A module the quantization_config leaves unquantized: its plain float weight."""
    w = get_tensor(sd, prefix + ".weight")
    if not w.is_floating_point() or w.element_size() == 1:
        raise CorruptCheckpointError(f"{prefix}.weight is {w.dtype} but the quantization_config leaves it unquantized")
    return DenseLinear(w)


def zero_point_is_zero(prefix: str, sd: Mapping[str, torch.Tensor]) -> None:
    zp = sd.get(prefix + ".weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        raise CorruptCheckpointError(f"{prefix}.weight_zero_point is not zero in a symmetric checkpoint")
