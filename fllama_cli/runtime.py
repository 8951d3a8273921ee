"""Shared by the run commands: load a model, choose the device, open a backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fllama_cli.errors import err_console
from fllama_cli.options import DeviceChoice
from kernels_cu.kv_codes import KvKind
from model_zoo.cpu_fast import CpuDtype
from model_zoo.errors import ConfigError, DeviceError
from model_zoo.quant.checkpoint import build_weights, int8_round_trip


@dataclass
class Opened:
    loaded: Any  # model_zoo.load.LoadedModel
    backend: Any  # model_zoo.backend.Backend
    device: str  # "cpu" | "cuda"
    lm_head_int8: bool = False
    load_s: float = 0.0  # reading the checkpoint and preparing its weights (dequantizing, laying out)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def config(self):
        return self.loaded.config

    def describe(self) -> str:
        dtype = getattr(self.backend, "compute", "fp16 compute")  # CpuModel says which weights and products
        head = ", lm_head int8" if self.lm_head_int8 else ""
        kv = getattr(getattr(self.backend, "cfg", None), "kv", KvKind.FP16)  # the engine's EngineConfig
        head += "" if kv is KvKind.FP16 else f", KV cache {kv.value}"
        threads = getattr(self.backend, "threads", None)
        dtype += "" if threads is None else f", {threads} thread{'s' if threads > 1 else ''}"
        return f"{self.backend.name} on {self.device}, {self.backend.scheme} weights{head}, {dtype}, load {self.load_s:.1f} s"


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


def open_model(source: str | None, *, device: DeviceChoice = DeviceChoice.auto, random: bool = False,
               seed: int | None = None, dtype: torch.dtype | None = None,
               kv: KvKind = KvKind.FP16, lm_head_int8: bool = False, max_context: int | None = None,
               cpu_dtype: CpuDtype | None = None) -> Opened:
    """cpu_dtype: the CPU backend's weight dtype (None: CpuDtype.FP16, the default of model_zoo.cpu_fast)."""
    from model_zoo.load import load_model

    t0 = time.perf_counter()
    dev = pick_device(device)
    if kv is not KvKind.FP16 and dev != "cuda":
        raise ConfigError(f"--kv-{kv.value} is an option of the GPU engine (--device cuda)")
    if cpu_dtype is not None and dev != "cpu":
        raise ConfigError("--cpu-dtype is an option of the CPU backend (--device cpu); the GPU engine computes in fp16")
    # the engine holds fp16, and loading straight to it gives the same weights (test_load_dtype) without an fp32
    # host copy: 32 GB for an 8B model
    loaded = load_model(source, random=random, seed=seed or 0, dtype=torch.float16 if dev == "cuda" else torch.float32)
    loaded.config = loaded.config.with_context(max_context)  # --max-context: what prompts and replies may use
    if dev == "cuda":
        from kernels_cu.engine import Engine, EngineConfig

        build_kernels()
        cfg = EngineConfig(kv=kv, lm_head_int8=lm_head_int8, max_len=max_context or EngineConfig.max_len)
        backend = Engine.from_loaded(loaded, cfg)
    else:
        from model_zoo.cpu_fast import CpuModel

        weights = build_weights(loaded, dtype or torch.float32, "cpu")
        if lm_head_int8:  # the engine's int8 head, as values: the reference's logits carry its rounding
            weights = replace(weights, lm_head=int8_round_trip(weights.lm_head))
        backend = CpuModel(weights, weight_dtype=cpu_dtype or CpuDtype.FP16)  # laid out (AWQ dequantized) at load
    # the backend holds its own weights: the host state dict would otherwise live as long as the session
    loaded.state_dict = {}
    return Opened(loaded, backend, dev, lm_head_int8, load_s=time.perf_counter() - t0)


def build_kernels() -> None:
    """On a GPU machine that has not built fllama's CUDA kernels yet, build them all now, side by side, with a
    progress bar on stderr (once per machine: the cubins are cached), rather than one at a time inside the first
    run's prefill and decode. Without a GPU or nvcc it leaves the engine to say what is missing."""
    from kernels_cu import build
    from kernels_cu.cuda_context import find_nvcc

    if not torch.cuda.is_available() or find_nvcc() is None:
        return
    arch = build.device_arch()
    files = build.unbuilt(arch)
    if not files:
        return
    t0 = time.perf_counter()
    err_console.print(f"[dim]building {len(files)} CUDA kernel files for {arch}: once on this machine, then cached[/]")
    with Progress(TextColumn("building"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("build", total=len(files))
        build.prebuild(arch, files, done=lambda _: bar.advance(task))
    err_console.print(f"[dim]built in {time.perf_counter() - t0:.0f} s[/]")
