"""`fllama info`: what a checkpoint is — architecture, sizes, scheme, tokenizer, chat template."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fllama_cli.options import JsonOpt, ModelArg, RandomOpt
from model_zoo.quant.checkpoint import describe_model

SUMMARY = "What a model or checkpoint is: architecture, sizes, scheme, tokenizer."
EXAMPLES = ("fllama info", "fllama info ./smollm2-awq --json", "fllama info llama2-7b --random")


def info_cmd(model: ModelArg = None, random: RandomOpt = False, json_out: JsonOpt = False) -> None:
    """Describe a model or checkpoint: architecture, sizes, quantization scheme, tokenizer, chat template."""
    info = describe_model(model, random)
    if json_out:
        print(json.dumps(info, default=str))
        return
    table = Table(title=f"fllama info · {escape(str(info['source']))}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in info.items():
        if key == "quantization_config":
            value = json.dumps(value) if value else "none"
        elif key == "parameters":
            value = f"{value / 1e6:.1f} M"
        elif key == "weight_bytes":
            value = f"{value / 2**20:.1f} MiB"
        elif value is None:
            continue
        table.add_row(key.replace("_", " "), escape(str(value)))  # names and paths are not markup
    Console(highlight=False).print(table)
