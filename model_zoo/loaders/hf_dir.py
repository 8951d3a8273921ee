"""Hugging Face model directories: config.json + safetensors (single or sharded) or pytorch_model*.bin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import safe_open

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.loaders.loaded_model import LoadedModel
from model_zoo.loaders.tensors import cast_floats, check_state_dict, cut_config, meta_tensor, stored_dtype, wanted
from model_zoo.quant.formats import scheme_of
from model_zoo.tokenizer import Tokenizer

FLLAMA_META = "fllama_meta.json"  # written by fllama's exporter beside config.json


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelSourceError(f"{directory} has no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CorruptCheckpointError(f"{path} does not hold a JSON object")
    return cfg


def hf_dir_config(directory: Path) -> LlamaConfig:
    """The LlamaConfig of a directory (UnsupportedArchitectureError unless model_type is llama)."""
    return LlamaConfig.from_hf(read_config_json(directory))


def load_hf_dir(directory: Path, *, dtype: torch.dtype, n_layers: int | None = None, source: str | None = None,
                kind: str = "hf-dir", shapes_only: bool = False,
                headers: Mapping[str, torch.Tensor] | None = None) -> LoadedModel:
    """shapes_only: the state dict holds meta tensors (the stored shapes and dtypes; no tensor data is read).
    headers: those meta tensors, read elsewhere (a hub model's), for a directory without its weights."""
    raw = read_config_json(directory)
    config = cut_config(LlamaConfig.from_hf(raw), n_layers)
    if headers is not None:
        stored = {name: t for name, t in headers.items() if wanted(name, n_layers)}
    else:
        stored = read_weights(directory, keep=lambda name: wanted(name, n_layers), shapes_only=shapes_only)
    quant = raw.get("quantization_config")
    scheme_of(quant)  # a layout fllama cannot run is refused before any tensor is converted
    check_state_dict(config, stored, quantized=quant is not None)
    meta = {"quantization_config": quant, "fllama": _read_optional_json(directory / FLLAMA_META),
            "dtype": stored_dtype(stored), "directory": str(directory)}
    return LoadedModel(config=config, tokenizer=Tokenizer.from_dir(directory), state_dict=cast_floats(stored, dtype),
                       source=source or str(directory), kind=kind, meta=meta)


def weight_files(directory: Path) -> list[Path]:
    """The files holding the weights, in the order HF would read them."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            return _shards_from_index(index)
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin", "pytorch_model*.bin"):
        found = sorted(directory.glob(pattern))
        if found:
            return found
    raise ModelSourceError(f"{directory} has config.json but no weights (model.safetensors, "
                           "model-*-of-*.safetensors with an index, or pytorch_model*.bin)")


def read_weights(directory: Path, keep: Callable[[str], bool] = lambda name: True,
                 shapes_only: bool = False) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        reader = _read_safetensors if path.suffix == ".safetensors" else _read_torch_bin
        sd.update(reader(path, keep, shapes_only))
    return sd


def _shards_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{index} is not a valid shard index ({type(e).__name__}: {e})") from None
    shards = [index.parent / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
        if not shard.is_file():
            raise CorruptCheckpointError(f"{index.name} lists the shard {shard.name}, which is missing")
    return shards


def _read_safetensors(path: Path, keep: Callable[[str], bool], shapes_only: bool) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            if shapes_only:  # the header alone
                views = {name: f.get_slice(name) for name in f.keys() if keep(name)}
                return {name: meta_tensor(v.get_dtype(), v.get_shape(), f"{path}: tensor {name}")
                        for name, v in views.items()}
            return {name: f.get_tensor(name) for name in f.keys() if keep(name)}
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on truncated files
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file ({e})") from None


def _read_torch_bin(path: Path, keep: Callable[[str], bool], shapes_only: bool) -> dict[str, torch.Tensor]:
    try:
        sd = _torch_load(path, shapes_only)
    except Exception as e:  # zip, pickle and unpickler-safety errors alike
        raise CorruptCheckpointError(f"{path} is not a readable PyTorch checkpoint ({type(e).__name__}: {e})") \
            from None
    if not isinstance(sd, dict):
        raise CorruptCheckpointError(f"{path} does not hold a state dict")
    sd = {k: v for k, v in sd.items() if keep(k) and isinstance(v, torch.Tensor)}
    return {k: v.to("meta") for k, v in sd.items()} if shapes_only else sd


def _torch_load(path: Path, shapes_only: bool) -> Any:
    if shapes_only:  # memory-mapped, so no tensor's data is read; files of torch's legacy format cannot be
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            pass
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_optional_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
