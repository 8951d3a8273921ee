"""`fllama serve PRESET --random --scheme awq`: a GPU engine of random weights in a chosen scheme, made on the GPU
one layer at a time as `fllama bench --random` makes them, so serving can be measured at a model's size (LLaMA-2-7B
awq) with no checkpoint and no host copy of its fp32 weights."""

from __future__ import annotations

import time

from fllama_cli.options import DeviceChoice
from fllama_cli.runtime import Opened, build_kernels, pick_device
from kernels_cu.kv_codes import KvKind
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.load import LoadedModel, load_tokenizer


def open_random_engine(preset: str, scheme: str, *, seed: int | None, kv: KvKind, lm_head_int8: bool,
                       max_context: int | None) -> Opened:
    t0 = time.perf_counter()
    pick_device(DeviceChoice.cuda)  # DeviceError, with the reason, without a usable GPU
    import torch

    from kernels_cu.bench import SCHEMES, random_weights
    from kernels_cu.engine import Engine, EngineConfig

    if scheme not in SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}; schemes: {', '.join(SCHEMES)}")
    build_kernels()
    config = LlamaConfig.from_name(preset).with_context(max_context)
    device = torch.device("cuda", torch.cuda.current_device())
    weights = random_weights(config, scheme, device, seed or 0)
    engine = Engine(weights, EngineConfig(kv=kv, lm_head_int8=lm_head_int8,
                                          max_len=max_context or EngineConfig.max_len))
    del weights
    loaded = LoadedModel(config=config, tokenizer=load_tokenizer(preset), state_dict={}, source=preset,
                         kind="random", meta={"scheme": scheme, "seed": seed or 0})
    return Opened(loaded, engine, "cuda", lm_head_int8, load_s=time.perf_counter() - t0)
