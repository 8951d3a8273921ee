"""GPTQ int4 checkpoints (AutoGPTQ, GPTQModel, optimum), imported exactly onto the AWQ int4 layout the kernels run.

Per Linear K -> N (REFERENCE.md section 10):
    qweight int32 [K/8, N]    nibble i (bits 4i..4i+3) of word r holds input row 8r + i (packed along K)
    qzeros  int32 [K/G, N/8]  nibble j of word c holds column 8c + j (packed along N, natural order)
    scales  fp16  [K/G, N]
    g_idx   int32 [K]         the group of each input row (k // G unless act-order permuted them)
and w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. Format v1 ("gptq", AutoGPTQ) stores z - 1 (so a
stored nibble 15 means z = 16, which AutoGPTQ's kernels and its torch path read differently: refused); v2
("gptq_v2", GPTQModel) stores z. The import re-packs q and z into AutoAWQ's layout, whose dequantization is the
same (q - z) * s, so the int4 kernels compute exactly what the GPTQ checkpoint holds.

Act-order (desc_act with a permuted g_idx): the input rows are sorted by group at load (a row permutation of the
repacked words, no measurable cost beside the repack), and the activations are gathered in that order before each
product (ActOrderLinear). The CPU reference runs it; the GPU engine's linears take their input unpermuted, so it
refuses these checkpoints in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.quant.awq_pack import AWQ_ORDER, PACK, QMAX, pack_awq
from model_zoo.quant.linear import AwqLinear

GROUP_SIZES = (32, 64, 128)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is added to a stored zero point


@dataclass(frozen=True)
class GptqLayout:
    group_size: int
    sym: bool
    desc_act: bool
    zero_offset: int  # 1 for v1's "zeros minus one", 0 for v2

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ModelSourceError(f"GPTQ group_size {self.group_size} is not supported; fllama runs groups of "
                                   f"{', '.join(map(str, GROUP_SIZES))}")
        if self.zero_offset not in (0, 1):
            raise ValueError(f"zero_offset must be 0 or 1, got {self.zero_offset}")

    @property
    def format(self) -> str:
        return "gptq" if self.zero_offset else "gptq_v2"


def parse_gptq_layout(qc: Mapping[str, Any]) -> GptqLayout:
    """config.json quantization_config (quant_method "gptq") -> GptqLayout; refuses what fllama cannot run."""
    bits = qc.get("bits")
    if bits != 4:
        raise ModelSourceError(f"GPTQ with {bits} bits is not supported; fllama runs 4-bit GPTQ")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in FORMATS or qc.get("is_marlin_format"):
        raise ModelSourceError(f"GPTQ checkpoint format {fmt!r} is not supported; fllama reads 'gptq' and 'gptq_v2' "
                               "(qweight [K/8, N] packed along K)")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ModelSourceError(f"GPTQ pack_dtype {qc.get('pack_dtype')!r} is not supported; fllama reads int32 words")
    if qc.get("lm_head"):
        raise ModelSourceError("a GPTQ-quantized lm_head is not supported; fllama keeps the lm_head in fp16")
    if qc.get("dynamic"):
        raise ModelSourceError("GPTQ 'dynamic' per-module overrides are not supported")
    group_size = qc.get("group_size")
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise ModelSourceError(f"GPTQ group_size {group_size!r} is not supported; fllama runs groups of "
                               f"{', '.join(map(str, GROUP_SIZES))}")
    return GptqLayout(group_size=group_size, sym=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                      zero_offset=FORMATS[fmt])


def to_awq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ int32 [K/8, N] (8 rows per word) -> AWQ int32 [K, N/8] (8 columns per word, AWQ_ORDER): the same
    codes, moved as bytes and nibbles: a few memory-bound passes, no per-element arithmetic."""
    k8, n = qweight.shape
    b = qweight.contiguous().view(torch.uint8).view(k8, n // PACK, PACK, 4)  # little endian: byte m = rows 2m, 2m+1
    b = b[:, :, list(AWQ_ORDER)]  # [K/8, N/8, i, m]: column 8c + AWQ_ORDER[i] at i
    rows = torch.stack((b & QMAX, b >> 4), dim=-1).view(k8, n // PACK, PACK, PACK)  # [K/8, N/8, i, j]: row 8r + j
    rows = rows.permute(0, 3, 1, 2)  # [K/8, j, N/8, i]
    words = rows[..., 0::2] | (rows[..., 1::2] << 4)  # [K/8, j, N/8, 4]: nibbles 2m, 2m + 1 in byte m
    return words.contiguous().view(torch.int32).view(k8 * PACK, n // PACK)  # [K, N/8]


def unpack_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] packed along N in natural order -> uint8 [R, N]."""
    shifts = 4 * torch.arange(PACK, dtype=torch.int32, device=qzeros.device)  # [8]
    z = (qzeros.unsqueeze(2) >> shifts) & QMAX  # [R, N/8, 8]
    return z.reshape(qzeros.shape[0], -1).to(torch.uint8)


class ActOrderLinear:
    """An act-order GPTQ linear: AwqLinear over the input rows sorted by group, with x gathered by `perm`."""

    gpu_refusal = ("act-order GPTQ (desc_act with a permuted g_idx) needs the activations gathered before each "
                   "int4 product, which the GPU engine does not do: run it with --device cpu, or use a desc_act: "
                   "false checkpoint")

    def __init__(self, inner: AwqLinear, perm: torch.Tensor):
        if perm.shape != (inner.in_features,):
            raise ValueError(f"perm must have {inner.in_features} entries, got {tuple(perm.shape)}")
        self.inner, self.perm = inner, perm.long()  # row j of inner is input row perm[j]
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))  # [..., K] in group order

    def dense_weight(self) -> torch.Tensor:
        sorted_w = self.inner.dense_weight()  # [N, K], input rows in group order
        w = torch.empty_like(sorted_w)
        w[:, self.perm] = sorted_w
        return w

    def to(self, device=None, dtype=None) -> "ActOrderLinear":
        return ActOrderLinear(self.inner.to(device, dtype), self.perm.to(device))

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.perm.numel() * 4  # g_idx as stored

    def __repr__(self) -> str:
        return f"ActOrderLinear({self.in_features} -> {self.out_features}, group_size={self.inner.group_size})"


def gptq_linear(prefix: str, sd: Mapping[str, torch.Tensor], layout: GptqLayout) -> AwqLinear | ActOrderLinear:
    """One GPTQ linear of the state dict as an AwqLinear (or ActOrderLinear) computing the same values."""
    qweight, qzeros, scales = (_get(sd, f"{prefix}.{name}") for name in ("qweight", "qzeros", "scales"))
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or not scales.is_floating_point():
        raise CorruptCheckpointError(f"{prefix}: GPTQ needs int32 qweight/qzeros and float scales, got "
                                     f"{qweight.dtype}, {qzeros.dtype}, {scales.dtype}")
    G = layout.group_size
    k, n = PACK * qweight.shape[0], qweight.shape[1]
    want = {"qweight": (qweight, 2, None), "qzeros": (qzeros, 2, (k // G, n // PACK)),
            "scales": (scales, 2, (k // G, n))}
    for name, (t, dims, shape) in want.items():
        if t.dim() != dims or (shape is not None and tuple(t.shape) != shape):
            raise CorruptCheckpointError(f"{prefix}.{name} has shape {tuple(t.shape)} but qweight "
                                         f"{tuple(qweight.shape)} with group size {G} needs {shape}")
    if k % G or n % PACK:
        raise CorruptCheckpointError(f"{prefix}: input size {k} is not a multiple of group size {G}, or output "
                                     f"size {n} of 8")
    z = unpack_cols(qzeros).to(torch.int16) + layout.zero_offset  # [K/G, N]
    if bool((z > QMAX).any()):
        raise ModelSourceError(f"{prefix}.qzeros stores 15 in GPTQ's v1 format (zero point 16), which AutoGPTQ's "
                               "kernels and its torch path read differently; re-save the model in gptq_v2 format")
    perm = _group_order(prefix, sd.get(f"{prefix}.g_idx"), k, G)
    awq_qweight = to_awq_qweight(qweight)  # [K, N/8]
    if perm is not None:
        awq_qweight = awq_qweight[perm].contiguous()  # input rows sorted by group
    inner = AwqLinear(awq_qweight, pack_awq(z.to(torch.uint8)), scales, G, dtype=scales.dtype)
    return inner if perm is None else ActOrderLinear(inner, perm)


def _group_order(prefix: str, g_idx: torch.Tensor | None, k: int, G: int) -> torch.Tensor | None:
    """None when g_idx is k // G (or absent); else the stable order that sorts the input rows by group."""
    if g_idx is None:
        return None
    if g_idx.dtype not in (torch.int32, torch.int64) or tuple(g_idx.shape) != (k,):
        raise CorruptCheckpointError(f"{prefix}.g_idx must be int32 [{k}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    g = g_idx.long()
    if torch.equal(g, torch.arange(k, device=g.device) // G):
        return None
    if bool((g < 0).any()) or bool((g >= k // G).any()) or bool((torch.bincount(g, minlength=k // G) != G).any()):
        raise CorruptCheckpointError(f"{prefix}.g_idx does not put {G} input rows in each of {k // G} groups")
    return torch.argsort(g, stable=True)


def describe_gptq(layout: GptqLayout) -> dict[str, Any]:
    return {"format": layout.format, "group_size": layout.group_size, "sym": layout.sym, "desc_act": layout.desc_act}


def _get(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return sd[name]
    except KeyError:
        raise CorruptCheckpointError(f"checkpoint lacks the tensor {name!r}") from None


__all__ = ["GptqLayout", "parse_gptq_layout", "gptq_linear", "ActOrderLinear", "describe_gptq", "to_awq_qweight",
           "unpack_cols"]
