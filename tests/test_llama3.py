"""Llama-3 / 3.1 / 3.2, Mistral, CodeLlama, TinyLlama: configs, RoPE scaling and parity with transformers.

transformers writes and runs the reference models (tiny random weights, CPU): fllama must give the same logits,
perplexity within 0.1% and the same greedy tokens. Config fields that change the math are computed or refused
in one line; no tensor is dropped without an error naming it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from model_zoo.config import PRESETS, LlamaConfig
from model_zoo.errors import ConfigError, UnsupportedArchitectureError
from model_zoo.generation import GenerationConfig, generate
from model_zoo.load import load_model, resolve_config
from model_zoo.quant.checkpoint import build_weights, describe_model
from model_zoo.reference import ReferenceModel
from model_zoo.rope import RopeScaling, RopeType, inv_freq
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import random_state_dict
from tests.helpers import EosTokenizer

transformers = pytest.importorskip("transformers")

# head_dim 16, theta 5e5: with an original context of 64, Llama-3's low / high wavelengths (64 and 16) fall among
# the model's 8 frequencies, so every branch of the llama3 rule is taken
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
MODELS = {  # name -> (transformers class name, config fields, sequence length)
    "llama3.1": ("Llama", dict(BASE, rope_theta=5e5, max_position_embeddings=512, rope_scaling=LLAMA3), 160),
    "llama3.1-tied": ("Llama", dict(BASE, rope_theta=5e5, max_position_embeddings=512, rope_scaling=LLAMA3,
                                    tie_word_embeddings=True), 160),
    "llama3.2": ("Llama", dict(BASE, head_dim=32, rope_theta=5e5, max_position_embeddings=512,
                               rope_scaling=dict(LLAMA3, factor=32.0), tie_word_embeddings=True), 160),
    "linear": ("Llama", dict(BASE, rope_theta=1e4, max_position_embeddings=256,
                             rope_scaling={"type": "linear", "factor": 4.0}), 120),
    "dynamic": ("Llama", dict(BASE, rope_theta=1e4, max_position_embeddings=64,
                              rope_scaling={"type": "dynamic", "factor": 2.0}), 80),
    "mistral": ("Mistral", dict(BASE, rope_theta=1e6, max_position_embeddings=512, sliding_window=96), 90),
    "codellama": ("Llama", dict(BASE, rope_theta=1e6, max_position_embeddings=16384), 120),
}


def hf_model(name: str, seed: int = 0):
    """A transformers model of MODELS[name] holding fllama's seeded random weights (a trained model's scale)."""
    kind, fields, _ = MODELS[name]
    hf_cfg = getattr(transformers, f"{kind}Config")(**fields)
    model = getattr(transformers, f"{kind}ForCausalLM")(hf_cfg).eval()
    shape = LlamaConfig(64, 2, 4, 2, 128, 300, head_dim=fields.get("head_dim", 0),
                        tie_embeddings=bool(fields.get("tie_word_embeddings")))
    sd = random_state_dict(shape, seed=seed)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (transformers model, the directory it saved itself to, with a byte tokenizer)."""
    out = {}
    for name in MODELS:
        model = hf_model(name)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        Tokenizer.byte_fallback(300).save(d)
        out[name] = (model, d)
    return out


def ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                            ids[:, 1:].reshape(-1))
    return math.exp(float(nll))


def hf_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """transformers' own generate, greedy, with no end-of-sequence id (so exactly n tokens)."""
    model.generation_config.eos_token_id = None
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_perplexity_and_greedy_tokens_match_transformers(saved, name):
    model, d = saved[name]
    loaded = load_model(d)
    ref = ReferenceModel(build_weights(loaded, torch.float32))
    S = MODELS[name][2]
    ids = torch.randint(0, 300, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits  # [2, S, V]
    got = ref.forward(ids)
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, f"{name}: logits differ by {rel:.2e}"
    assert abs(ppl(got, ids) / ppl(want, ids) - 1) < 1e-3
    if loaded.config.rope_scaling is not None:  # the test's power: plain RoPE on the same weights differs
        ref.config = ref.weights.config = loaded.config.replace(rope_scaling=None)
        assert float((ref.forward(ids[:1]) - want[:1]).norm() / want[:1].norm()) > 1e-3
        ref.config = ref.weights.config = loaded.config
    prompt = ids[:1, : S - 20]  # dynamic: the reply crosses the original context (64)
    tok = EosTokenizer(loaded.tokenizer, set())
    cfg = GenerationConfig(max_new_tokens=8, sampling=SamplingConfig(temperature=0.0))
    (res,), _ = generate(ref, tok, [prompt[0].tolist()], cfg)
    assert res.tokens == hf_greedy(model, prompt, 8), name


@pytest.mark.parametrize("rope", [LLAMA3, dict(LLAMA3, factor=32.0), {"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "dynamic", "factor": 2.0}])
@pytest.mark.parametrize("seq_len", [None, 64, 65, 300])
def test_inv_freq_equals_transformers_bit_for_bit(rope, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(**dict(BASE, head_dim=32, rope_theta=5e5, max_position_embeddings=64,
                                             rope_scaling=dict(rope, original_max_position_embeddings=32)
                                             if rope["rope_type"] == "llama3" else rope))
    kind = rope["rope_type"]
    if kind == "dynamic" and seq_len is not None:
        want, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", seq_len=torch.tensor(seq_len))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    scaling = LlamaConfig.from_hf(hf_cfg.to_dict()).rope_scaling
    assert torch.equal(inv_freq(32, 5e5, scaling, seq_len), want)


@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "linear", "dynamic"])
def test_the_engine_rope_table_is_the_reference_cos_sin(saved, name):
    """kernels_cu.rope_kv.rope_table (the engine's table; dynamic: within its original context) against the
    reference's cos/sin in fp32."""
    from kernels_cu.rope_kv import rope_positions, rope_table
    from model_zoo.reference import rope_cos_sin

    c = load_model(saved[name][1]).config
    n = rope_positions(c)  # dynamic: 64, its original context; the others: the whole context
    assert n == (64 if name == "dynamic" else c.max_positions)
    table = rope_table(c.head_dim, c.rope_theta, n, "cpu", c.rope_scaling)  # [n, d]: cos | sin of d/2 each
    cos, sin = rope_cos_sin(c, torch.arange(n), torch.float32)  # [n, d]
    half = c.head_dim // 2
    assert torch.equal(table[:, :half], cos[:, :half]) and torch.equal(table[:, half:], sin[:, :half])


# --- configs as published ------------------------------------------------------------------------------------
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
              "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
LLAMA32_1B = dict(LLAMA31_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                  tie_word_embeddings=True, eos_token_id=128001,
                  rope_scaling=dict(LLAMA31_8B["rope_scaling"], factor=32.0))
MISTRAL_V01 = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
               "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
               "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
               "tie_word_embeddings": False, "vocab_size": 32000}
MISTRAL_V03 = dict(MISTRAL_V01, rope_theta=1000000.0, sliding_window=None, vocab_size=32768)
CODELLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                "num_key_value_heads": 32, "num_hidden_layers": 32, "max_position_embeddings": 16384,
                "rope_theta": 1000000, "vocab_size": 32016, "rms_norm_eps": 1e-05, "rope_scaling": None}
TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "num_hidden_layers": 22, "max_position_embeddings": 2048, "rope_theta": 10000.0,
             "vocab_size": 32000, "rms_norm_eps": 1e-05}


def test_published_configs():
    c = LlamaConfig.from_hf(LLAMA31_8B)
    assert (c.vocab_size, c.n_kv_heads, c.max_positions, c.rope_theta, c.eos_id) == (128256, 8, 131072, 5e5, 128001)
    assert c.rope_scaling == RopeScaling(RopeType.LLAMA3, 8.0, 8192, 1.0, 4.0)
    assert c.n_params() == PRESETS["llama3.1-8b"].n_params() == 8_030_261_248
    c = LlamaConfig.from_hf(LLAMA32_1B)
    assert c.tie_embeddings and c.head_dim == 64 and c.rope_scaling.factor == 32.0
    assert c.n_params() == PRESETS["llama3.2-1b"].n_params()
    mistral = LlamaConfig.from_hf(MISTRAL_V01)
    assert mistral.sliding_window == 4096 and mistral.max_positions == 4096  # the context stops at the window
    assert LlamaConfig.from_hf(MISTRAL_V03).max_positions == 32768
    assert LlamaConfig.from_hf(CODELLAMA_7B).rope_theta == 1e6
    assert LlamaConfig.from_hf(TINYLLAMA).gqa_ratio == 8
    dyn = LlamaConfig.from_hf(dict(TINYLLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert dyn.max_positions == 4096 and dyn.to_hf()["max_position_embeddings"] == 2048  # the formula's context


def test_transformers_reads_what_to_hf_writes():
    c = LlamaConfig.from_hf(LLAMA31_8B)
    back = LlamaConfig.from_hf(transformers.LlamaConfig(**c.to_hf()).to_dict())
    assert back.replace(name=c.name) == c


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.1-8b", "llama3.1-70b", "llama3.2-1b", "llama3.2-3b"])
def test_llama3_presets(name):
    c = LlamaConfig.from_name(name)
    want = {"llama3-8b": 8_030_261_248, "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496,
            "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824}[name]  # the published parameter counts
    assert c.n_params() == want and c.vocab_size == 128256 and c.n_kv_heads == 8
    assert (c.rope_scaling is None) == (name == "llama3-8b")


def test_max_context():
    c = LlamaConfig.from_hf(LLAMA31_8B)
    assert c.with_context(None) is c and c.with_context(32768).max_positions == 32768
    with pytest.raises(ConfigError, match="exceeds the model's context of 131072"):
        c.with_context(200_000)
    with pytest.raises(ConfigError, match="sliding window"):
        LlamaConfig.from_hf(MISTRAL_V01).with_context(8192)


# --- what fllama refuses, in one line ----------------------------------------------------------------------
@pytest.mark.parametrize("changes,needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "qwen2"}, "qwen2"),
])
def test_math_changing_fields_are_refused(changes, needle):
    with pytest.raises(UnsupportedArchitectureError, match=needle):
        LlamaConfig.from_hf(dict(LLAMA31_8B, **changes))


@pytest.fixture()
def tiny_dir(saved, tmp_path):
    """A copy of the llama3.1 checkpoint whose tensors a test may change."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(saved["llama3.1"][1], d)
    return d


def _edit_tensors(d, fn) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def test_a_nonzero_bias_is_refused_by_name_and_a_zero_one_is_exact(tiny_dir):
    name = "model.layers.1.self_attn.q_proj.bias"
    _edit_tensors(tiny_dir, lambda sd: sd.__setitem__(name, torch.zeros(64)))
    load_model(tiny_dir)  # a zero bias adds nothing: computed exactly without it
    _edit_tensors(tiny_dir, lambda sd: sd.__setitem__(name, torch.full((64,), 0.1)))
    with pytest.raises(UnsupportedArchitectureError, match=name):
        load_model(tiny_dir)


def test_unknown_tensors_are_refused_by_name(tiny_dir):
    _edit_tensors(tiny_dir, lambda sd: sd.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)))
    with pytest.raises(UnsupportedArchitectureError, match="q_norm"):
        load_model(tiny_dir)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(saved, tmp_path):
    import shutil

    d = tmp_path / "t"
    shutil.copytree(saved["llama3.2"][1], d)
    _edit_tensors(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"].clone()))
    load_model(d)  # a stored copy of the embedding is the same model
    _edit_tensors(d, lambda sd: sd.__setitem__("lm_head.weight", sd["model.embed_tokens.weight"] * 2))
    with pytest.raises(UnsupportedArchitectureError, match="lm_head"):
        load_model(d)


def test_info_describes_a_llama31_checkpoint(saved):
    info = describe_model(str(saved["llama3.1"][1]))
    assert info["rope_scaling"].startswith("llama3 (factor 8") and info["context"] == 512
    assert resolve_config(saved["mistral"][1]).sliding_window == 96


def test_cli_refuses_gelu_and_a_long_max_context_in_one_line(saved, tmp_path, capsys, monkeypatch):
    from tests.test_cli import assert_one_line_error, fllama

    d = saved["llama3.1"][1]
    code, _, err = fllama(capsys, monkeypatch, "generate", d, "-p", "hi", "-n", "2", "--device", "cpu",
                          "--max-context", "1000")
    assert_one_line_error(code, err, "exceeds the model's context of 512")
    code, out, err = fllama(capsys, monkeypatch, "generate", d, "-p", "hi", "-n", "2", "--device", "cpu",
                            "--temperature", "0", "--max-context", "64", "--json")
    assert code == 0, err
    bad = tmp_path / "gelu"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(json.loads((d / "config.json").read_text()), hidden_act="gelu")))
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_bytes((d / f).read_bytes())
    code, _, err = fllama(capsys, monkeypatch, "info", bad)
    assert_one_line_error(code, err, "hidden_act 'gelu'")
