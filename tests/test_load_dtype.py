"""The GPU path loads checkpoints straight to fp16 (fllama_cli.runtime.open_model): the engine's weights must be the
ones an fp32 load gives, bit for bit, for every format (build_weights(..., float16) is what Engine.from_loaded
holds)."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch

from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from tests._fixtures_loaders import write_hf_dir
from tests.test_cli import CFG, fllama
from tests.test_gptq import write_gptq_dir


def leaves(obj, path: str = "w") -> dict[str, object]:
    """Every tensor and plain value reachable from a ModelWeights (its layers and linears), by attribute path."""
    if isinstance(obj, (torch.Tensor, enum.Enum, str, int, float, bool, type(None), torch.dtype)):
        return {path: obj}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, o in enumerate(obj) for k, v in leaves(o, f"{path}[{i}]").items()}
    if isinstance(obj, dict):
        return {k: v for name, o in obj.items() for k, v in leaves(o, f"{path}[{name!r}]").items()}
    if type(obj).__module__.startswith("model_zoo"):
        return {k: v for name, o in vars(obj).items() for k, v in leaves(o, f"{path}.{name}").items()}
    raise TypeError(f"{path}: {type(obj).__name__} is not compared")


def assert_same_engine_weights(source) -> None:
    a = leaves(build_weights(load_model(source, dtype=torch.float32), torch.float16))
    b = leaves(build_weights(load_model(source, dtype=torch.float16), torch.float16))
    assert a.keys() == b.keys() and sum(isinstance(v, torch.Tensor) for v in a.values()) > 10
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dense") / "m"
    write_hf_dir(d, CFG)
    return d


@pytest.mark.parametrize("kind", ["fp16", "bf16", "fp32", "bin"])
def test_unquantized_checkpoints(tmp_path, dense, kind):
    if kind == "fp16":
        return assert_same_engine_weights(dense)
    sd = load_model(dense).state_dict
    d = tmp_path / kind
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "bin": torch.float16}[kind]
    write_hf_dir(d, CFG, {k: v.to(dtype) for k, v in sd.items()}, fmt="bin" if kind == "bin" else "safetensors")
    assert_same_engine_weights(d)


@pytest.mark.parametrize("scheme", [["--scheme", "int8"], ["--scheme", "fp8"],
                                    ["--scheme", "awq", "--group-size", "32", "--method", "rtn"]])
def test_fllamas_own_exports(capsys, monkeypatch, dense, tmp_path, scheme):
    code, _, err = fllama(capsys, monkeypatch, "quantize", dense, "-o", tmp_path / "q", "--device", "cpu", *scheme)
    assert code == 0, err
    assert_same_engine_weights(tmp_path / "q")


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq(tmp_path, act_order):
    write_gptq_dir(tmp_path / "g", G=32, sym=False, act_order=act_order)
    assert_same_engine_weights(tmp_path / "g")
