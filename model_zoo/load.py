"""load_model: one entry point for every model source fllama accepts.

Resolution order: None -> DEFAULT_MODEL; an existing directory -> HF dir (or the single .gguf inside it);
an existing .gguf file -> GGUF; a named model ("smollm2-135m") -> the GGUF a pip package ships; a preset name
-> random weights (only with random=True); "org/name" -> hub snapshot, then HF dir; else ModelSourceError.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import torch

from model_zoo.config import PRESETS, LlamaConfig
from model_zoo.errors import ModelSourceError
from model_zoo.loaders import (NAMED_MODELS, LoadedModel, download, hf_dir_config, hub_headers, is_named, load_gguf,
                               load_hf_dir, load_random, looks_like_hub_id, named_model_path, read_gguf_config)
from model_zoo.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"

ACCEPTED_FORMS = ("a Hugging Face model directory (config.json + *.safetensors or pytorch_model*.bin)",
                  "a .gguf file", f"a named model ({', '.join(NAMED_MODELS)})",
                  "a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct",
                  f"a preset with --random ({', '.join(PRESETS)})")


class SourceKind(enum.Enum):
    HF_DIR = "hf-dir"
    GGUF = "gguf"
    NAMED = "named"
    PRESET = "preset"
    HUB = "hub"


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    target: str  # the path, name or hub id to load
    given: str  # what the user wrote

    def __post_init__(self) -> None:
        if not self.target:
            raise ModelSourceError("empty model source")


def classify_source(source: str | Path | None) -> ModelSource:
    """Which kind of source `source` is; ModelSourceError when it is none of them."""
    given = DEFAULT_MODEL if source is None else str(source)
    if not given.strip():
        raise ModelSourceError("empty model source; accepted: " + "; ".join(ACCEPTED_FORMS))
    path = Path(given).expanduser()
    if path.is_dir():
        return _classify_dir(path, given)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf; give the directory that holds config.json "
                                   "and the weights")
        return ModelSource(SourceKind.GGUF, str(path.resolve()), given)
    if is_named(given):
        return ModelSource(SourceKind.NAMED, given.lower(), given)
    if given.lower() in PRESETS:
        return ModelSource(SourceKind.PRESET, given.lower(), given)
    if looks_like_hub_id(given):
        return ModelSource(SourceKind.HUB, given, given)
    if _looks_like_path(given):
        raise ModelSourceError(f"no such file or directory: {given}")
    raise ModelSourceError(f"unknown model source {given!r}; accepted: " + "; ".join(ACCEPTED_FORMS))


def load_model(source: str | Path | None = None, *, random: bool = False, seed: int = 0,
               dtype: torch.dtype = torch.float32, n_layers: int | None = None,
               shapes_only: bool = False) -> LoadedModel:
    """Config, tokenizer and HF-named state dict of a model source (see the module docstring). shapes_only: the
    checkpoint's tensors as meta tensors, read from its headers and checked as a load checks them (`fllama info`:
    an 8B checkpoint's load would read 32 GB of fp32 first)."""
    src = classify_source(source)
    if random:
        return _load_random(src, seed=seed, dtype=dtype, n_layers=n_layers)
    kind = src.kind
    if kind is SourceKind.HF_DIR:
        return load_hf_dir(Path(src.target), dtype=dtype, n_layers=n_layers, shapes_only=shapes_only)
    if kind is SourceKind.GGUF:
        return load_gguf(Path(src.target), dtype=dtype, n_layers=n_layers, shapes_only=shapes_only)
    if kind is SourceKind.NAMED:
        loaded = load_gguf(named_model_path(src.target), dtype=dtype, n_layers=n_layers, kind="named",
                           shapes_only=shapes_only)
        loaded.meta["named"] = src.target
        return loaded
    if kind is SourceKind.HUB:
        if shapes_only:
            return _hub_shapes(src.target, dtype, n_layers)
        return load_hf_dir(download(src.target), dtype=dtype, n_layers=n_layers, source=src.target, kind="hub")
    raise ModelSourceError(f"{src.given!r} is a preset shape without weights: add --random for random weights, "
                           "or give weights (an HF directory, a .gguf file or a hub id)")


def _hub_shapes(source: str, dtype: torch.dtype, n_layers: int | None) -> LoadedModel:
    """A hub model from its config, tokenizer and safetensors headers, with no weight downloaded; where the hub
    cannot be reached, a snapshot already in the local cache (offline), or the download's own error."""
    try:
        headers = hub_headers(source)
    except ModelSourceError:
        return load_hf_dir(download(source), dtype=dtype, n_layers=n_layers, source=source, kind="hub",
                           shapes_only=True)
    return load_hf_dir(download(source, files="no-weights"), dtype=dtype, n_layers=n_layers, source=source,
                       kind="hub", headers=headers)


def resolve_config(source: str | Path | None = None) -> LlamaConfig:
    """The model's config alone, without reading weights (for `fllama info` and option checks)."""
    src = classify_source(source)
    if src.kind is SourceKind.HF_DIR:
        return hf_dir_config(Path(src.target))
    if src.kind is SourceKind.GGUF:
        return read_gguf_config(Path(src.target))
    if src.kind is SourceKind.NAMED:
        return read_gguf_config(named_model_path(src.target))
    if src.kind is SourceKind.HUB:
        return hf_dir_config(download(src.target, files="config"))
    return LlamaConfig.from_name(src.target)


def load_tokenizer(source: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model source (byte fallback for presets without one)."""
    config, tokenizer = _config_and_tokenizer(classify_source(source))
    return tokenizer or Tokenizer.byte_fallback(config.vocab_size)


def _load_random(src: ModelSource, *, seed: int, dtype: torch.dtype, n_layers: int | None) -> LoadedModel:
    config, tokenizer = _config_and_tokenizer(src)
    return load_random(config, source=src.target, seed=seed, dtype=dtype, n_layers=n_layers, tokenizer=tokenizer)


def _config_and_tokenizer(src: ModelSource) -> tuple[LlamaConfig, Tokenizer | None]:
    """Shape and tokenizer of a source; the tokenizer is None for a preset without a vocabulary."""
    if src.kind is SourceKind.PRESET or (src.kind is SourceKind.NAMED and src.target in PRESETS):
        config = LlamaConfig.from_name(src.target)
        try:  # a preset that is also a named model uses that model's real tokenizer when it is installed
            tokenizer = Tokenizer.from_gguf(named_model_path(src.target)) if is_named(src.target) else None
        except ModelSourceError:
            tokenizer = None
        return config, tokenizer
    if src.kind in (SourceKind.GGUF, SourceKind.NAMED):
        path = Path(src.target) if src.kind is SourceKind.GGUF else named_model_path(src.target)
        return read_gguf_config(path), Tokenizer.from_gguf(path)
    directory = Path(src.target) if src.kind is SourceKind.HF_DIR else download(src.target, files="no-weights")
    return hf_dir_config(directory), Tokenizer.from_dir(directory)


def _classify_dir(path: Path, given: str) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(SourceKind.HF_DIR, str(path.resolve()), given)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(SourceKind.GGUF, str(ggufs[0].resolve()), given)
    what = f"{len(ggufs)} .gguf files (give one)" if ggufs else "no config.json and no .gguf file"
    raise ModelSourceError(f"{path} is a directory with {what}")


def _looks_like_path(s: str) -> bool:
    return "/" in s or "\\" in s or s.startswith(("~", ".")) or s.lower().endswith((".gguf", ".safetensors", ".bin"))


__all__ = ["LoadedModel", "load_model", "resolve_config", "load_tokenizer", "classify_source", "ModelSource",
           "SourceKind", "DEFAULT_MODEL"]
