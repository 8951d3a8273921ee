"""Shared by the run commands: load a model, choose the device, open a backend."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from fllama_cli.options import DeviceChoice
from model_zoo.errors import ConfigError, DeviceError


@dataclass
class Opened:
    loaded: Any  # model_zoo.load.LoadedModel
    backend: Any  # model_zoo.backend.Backend
    device: str  # "cpu" | "cuda"
    lm_head_int8: bool = False

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def config(self):
        return self.loaded.config

    def describe(self) -> str:
        dtype = "fp32 compute" if self.device == "cpu" else "fp16 compute"
        head = ", lm_head int8" if self.lm_head_int8 else ""
        return f"{self.backend.name} on {self.device}, {self.backend.scheme} weights{head}, {dtype}"


def gpu_usable() -> tuple[bool, str]:
    """Whether the GPU engine can run here, and if not, the one-line reason."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to PyTorch"
    try:
        from kernels_cu.build import require_cuda
        require_cuda()
    except DeviceError as e:
        return False, str(e)
    except ImportError as e:
        return False, f"the GPU engine is not available ({e})"
    return True, ""


def pick_device(choice: DeviceChoice) -> str:
    if choice == DeviceChoice.cpu:
        return "cpu"
    ok, why = gpu_usable()
    if choice == DeviceChoice.cuda:
        if not ok:
            raise DeviceError(f"--device cuda: {why}")
        return "cuda"
    return "cuda" if ok else "cpu"


def torch_device(choice: DeviceChoice) -> str:
    """For work done in torch (calibration, quantization): the GPU when asked for or present."""
    if choice == DeviceChoice.cuda and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA GPU visible to PyTorch")
    return "cuda" if choice != DeviceChoice.cpu and torch.cuda.is_available() else "cpu"


def build_weights(loaded: Any, dtype: torch.dtype, device: str = "cpu"):
    """ModelWeights for a loaded checkpoint, quantized linears included, on `device` in `dtype`."""
    from model_zoo.formats import Scheme, load_quantized_weights, scheme_of
    from model_zoo.weights import ModelWeights

    qcfg = loaded.meta.get("quantization_config")
    if scheme_of(qcfg) == Scheme.FP16:
        weights = ModelWeights.from_state_dict(loaded.config, loaded.state_dict, meta={"scheme": "fp16"})
    else:
        weights = load_quantized_weights(loaded.config, loaded.state_dict, qcfg, dtype)
    return weights.to(device, dtype)


def open_model(source: str | None, *, device: DeviceChoice = DeviceChoice.auto, random: bool = False,
               seed: int | None = None, dtype: torch.dtype | None = None,
               kv_int8: bool = False, lm_head_int8: bool = False) -> Opened:
    from model_zoo.load import load_model

    dev = pick_device(device)
    if kv_int8 and dev != "cuda":
        raise ConfigError("--kv-int8 is an option of the GPU engine (--device cuda)")
    loaded = load_model(source, random=random, seed=seed or 0, dtype=torch.float32)
    if dev == "cuda":
        from kernels_cu.engine import Engine, EngineConfig

        backend = Engine.from_loaded(loaded, EngineConfig(kv_int8=kv_int8, lm_head_int8=lm_head_int8))
    else:
        from model_zoo.reference import ReferenceModel

        weights = build_weights(loaded, dtype or torch.float32, "cpu")
        if lm_head_int8:  # the engine's int8 head, as values: the reference's logits carry its rounding
            weights = replace(weights, lm_head=int8_round_trip(weights.lm_head))
        backend = ReferenceModel(weights)
    return Opened(loaded, backend, dev, lm_head_int8)


def int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] through the int8 lm_head's codes and scales (calibrate.int8, one scale per row) and back."""
    from calibrate.int8 import dequantize_weight_int8, quantize_weight_int8

    return dequantize_weight_int8(*quantize_weight_int8(w), dtype=w.dtype)


def read_prompt_arg(prompts: list[str] | None) -> list[str]:
    """-p values, or the whole of stdin when none is given and stdin is not a terminal."""
    if prompts:
        return prompts
    if not sys.stdin.isatty():
        return [sys.stdin.read()]
    return []

