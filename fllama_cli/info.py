"""`fllama info`: what a checkpoint is — architecture, sizes, scheme, tokenizer, chat template."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from fllama_cli.options import JsonOpt, ModelArg, RandomOpt
from model_zoo.load import load_model


def describe_model(source: str | None, random: bool = False) -> dict:
    from fllama_cli.runtime import build_weights
    from model_zoo.formats import scheme_of

    import torch

    loaded = load_model(source, random=random)
    c = loaded.config
    qcfg = loaded.meta.get("quantization_config")
    weights = build_weights(loaded, torch.float16)
    tok = loaded.tokenizer
    fl = loaded.meta.get("fllama") or {}
    info = {
        "source": loaded.source,
        "kind": loaded.kind,
        "architecture": "llama",
        "name": c.name,
        "layers": c.n_layers,
        "hidden_size": c.hidden_size,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "ffn_size": c.ffn_size,
        "vocab_size": c.vocab_size,
        "context": c.max_positions,
        "rope_theta": c.rope_theta,
        "tied_embeddings": c.tie_embeddings,
        "parameters": c.n_params(),
        "scheme": scheme_of(qcfg).value,
        "stored_dtype": loaded.meta.get("dtype"),
        "weight_bytes": weights.nbytes(),
        "quantization_config": qcfg,
        "calibrator": fl.get("calibrator"),
        "group_size": (qcfg or {}).get("group_size"),
        "tokenizer": type(tok).__name__ + (f" ({tok.kind})" if hasattr(tok, "kind") else ""),
        "bos_id": tok.bos_id,
        "eos_ids": sorted(tok.eos_ids),
        "chat_template": tok.chat_template is not None,
    }
    if loaded.meta.get("gguf_file_type") is not None:
        info["gguf_file_type"] = loaded.meta["gguf_file_type"]
    return info


def info_cmd(model: ModelArg = None, random: RandomOpt = False, json_out: JsonOpt = False) -> None:
    """Describe a model or checkpoint: architecture, sizes, quantization scheme, tokenizer, chat template."""
    info = describe_model(model, random)
    if json_out:
        print(json.dumps(info, default=str))
        return
    table = Table(title=f"fllama info · {info['source']}", show_header=False)
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
        table.add_row(key.replace("_", " "), str(value))
    Console(highlight=False).print(table)
