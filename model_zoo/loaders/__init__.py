"""Checkpoint loaders, one per kind of model source; model_zoo.load chooses among them."""

from model_zoo.loaders.gguf_file import load_gguf, read_gguf_config
from model_zoo.loaders.hf_dir import hf_dir_config, load_hf_dir
from model_zoo.loaders.hub import download, hub_headers, looks_like_hub_id
from model_zoo.loaders.loaded_model import LoadedModel
from model_zoo.loaders.named import NAMED_MODELS, is_named, named_model_path
from model_zoo.loaders.random_preset import load_random

__all__ = ["LoadedModel", "load_gguf", "read_gguf_config", "load_hf_dir", "hf_dir_config", "download", "hub_headers",
           "looks_like_hub_id", "NAMED_MODELS", "is_named", "named_model_path", "load_random"]
