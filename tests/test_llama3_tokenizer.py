"""Llama-3's tokenizer, chat template and stop ids, from tokenizer.json and from a GGUF file (`llama-bpe`), and
Llama-3.1's RoPE scaling as llama.cpp stores it (rope_freqs.weight).

The vocabulary is Llama-3's layout: a byte-level BPE (trained here on Sherlock Holmes, padded to 128,000
entries) split with Llama-3's regex, then the 256 special tokens at 128,000..128,255. transformers reads the same
files as the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_zoo.chat_template import LLAMA3_TEMPLATE, encode_chat, render_chat
from model_zoo.config import LlamaConfig
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.reference import ReferenceModel
from model_zoo.rope import RopeScaling, RopeType
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import random_state_dict
from tests._fixtures_loaders import (add_llama_header, big_text_lines, gguf_name, needs_big_txt, permute_qk,
                                     sample_paragraphs)

transformers = pytest.importorskip("transformers")
pytestmark = needs_big_txt

# Llama-3's pre-tokenizer regex, as its tokenizer.json writes it
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + [f"<|reserved_special_token_{k}|>" for k in range(3, 248)])
BOS, EOT, END = 128000, 128009, 128001
# Llama-3.1-Instruct's template without its tool-calling branches (the same Jinja features: namespace-free
# sets, trim, slicing, date defaults)
TEMPLATE_31 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": " What is 2+2? "},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3×3 — in words?"}]


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    """tokenizer.json + tokenizer_config.json + generation_config.json laid out as Llama-3.1-Instruct's."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(big_text_lines()[40:3000], trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    js = json.loads(tok.to_str())
    vocab = js["model"]["vocab"]
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), BOS)})  # Llama-3's 128,000 regular entries
    js["added_tokens"] = [{"id": BOS + k, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                           "normalized": False, "special": True} for k, t in enumerate(SPECIALS)]
    bos = {"SpecialToken": {"id": SPECIALS[0], "type_id": 0}}
    js["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                                     {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {SPECIALS[0]: {"id": SPECIALS[0], "ids": [BOS], "tokens": [SPECIALS[0]]}}}
    d = tmp_path_factory.mktemp("llama3tok")
    (d / "tokenizer.json").write_text(json.dumps(js))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": "<|eot_id|>", "chat_template": TEMPLATE_31,
        "clean_up_tokenization_spaces": True, "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": [END, 128008, EOT]}))
    return d


@pytest.fixture(scope="module")
def hf_tok(llama3_dir):
    return transformers.AutoTokenizer.from_pretrained(str(llama3_dir))


def test_encode_decode_and_stop_ids_match_transformers(llama3_dir, hf_tok):
    tok = Tokenizer.from_dir(llama3_dir)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (128256, BOS, EOT, True)
    assert {END, EOT} <= tok.eos_ids  # <|end_of_text|> and <|eot_id|> both end a reply
    for text in sample_paragraphs() + [render_chat(TEMPLATE_31, MESSAGES, bos_token="", eos_token="")]:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text[:60]
        assert tok.decode(ids) == hf_tok.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("gen", [True, False])
def test_llama31_chat_template_matches_transformers(llama3_dir, hf_tok, gen):
    tok = Tokenizer.from_dir(llama3_dir)
    want = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert render_chat(tok.chat_template, MESSAGES, bos_token=tok.bos_token, eos_token=tok.eos_token,
                       add_generation_prompt=gen) == want
    ids = encode_chat(tok, MESSAGES, gen)
    assert ids == hf_tok.encode(want, add_special_tokens=False) and ids[0] == BOS and ids.count(BOS) == 1


def test_a_llama3_vocabulary_without_a_template_gets_llama3s_format(llama3_dir, hf_tok, tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((llama3_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[0], "eos_token": "<|end_of_text|>"}))
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    msgs = MESSAGES[1:2]
    ids = encode_chat(tok, msgs)
    want = hf_tok.apply_chat_template(msgs, chat_template=LLAMA3_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert want == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>" \
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert ids == hf_tok.encode(want, add_special_tokens=False)


# --- GGUF: llama-bpe vocabulary and rope_freqs.weight -------------------------------------------------------
def llama_cpp_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                           orig: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for a llama3 rope_scaling (one divisor per
    frequency), written out here from its published rule."""
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama32_gguf(path: Path, tok_dir: Path, config: LlamaConfig, sd: dict[str, torch.Tensor]) -> None:
    """A Llama-3.2-style GGUF: byte-level BPE vocabulary ('llama-bpe'), tied embeddings, F32 tensors."""
    js = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = {**js["model"]["vocab"], **{t["content"]: t["id"] for t in js["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in js["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(w, config)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if i >= BOS else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOT)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE_31)
    w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(config.rope_theta, config.head_dim, 32.0, 1.0, 4.0,
                                                             8192))
    for name, t in sorted(sd.items()):
        arr = t.float().numpy()
        if name.endswith("q_proj.weight"):
            arr = permute_qk(arr, config.n_heads)
        elif name.endswith("k_proj.weight"):
            arr = permute_qk(arr, config.n_kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(arr), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama32_gguf_vocabulary_rope_factors_and_logits(llama3_dir, tmp_path):
    config = LlamaConfig(64, 2, 4, 2, 128, 128256, rope_theta=500000.0, max_positions=2048, tie_embeddings=True,
                         norm_eps=1e-5)
    sd = random_state_dict(config, seed=4)
    path = tmp_path / "llama32.gguf"
    write_llama32_gguf(path, llama3_dir, config, sd)
    loaded = load_model(path)
    assert loaded.config.rope_scaling == RopeScaling(RopeType.LLAMA3, 32.0, 8192, 1.0, 4.0)
    json_tok = Tokenizer.from_dir(llama3_dir)
    for text in sample_paragraphs():
        assert loaded.tokenizer.encode(text) == json_tok.encode(text), text[:60]
    assert {END, EOT} <= loaded.tokenizer.eos_ids and loaded.tokenizer.bos_id == BOS
    # the same weights in transformers with Llama-3.2's rope_scaling: the GGUF's factors compute the same model
    hf_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128256,
                                      rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=True,
                                      rms_norm_eps=1e-5, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 8192})
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(sd, strict=False)
    ids = torch.tensor([loaded.tokenizer.encode(sample_paragraphs()[0])[:200]])  # [1, 200]
    with torch.no_grad():
        want = model(ids).logits
    got = ReferenceModel(build_weights(loaded, torch.float32)).forward(ids)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_gguf_tensors_without_a_place_are_refused(tmp_path):
    from model_zoo.errors import UnsupportedArchitectureError

    path = tmp_path / "extra.gguf"
    config = LlamaConfig(64, 1, 4, 2, 96, 512, max_positions=256)
    sd = random_state_dict(config, seed=1)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3-style tensor in a llama file
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64), ("vocab_size", 512),
                       ("feed_forward_length", 96), ("attention.head_count", 4), ("attention.head_count_kv", 2)):
        w.add_uint32(f"llama.{key}", value)
    for name, t in sorted(sd.items()):
        gname = "blk.0.attn_q_norm.weight" if "q_norm" in name else gguf_name(name)
        w.add_tensor(gname, t.float().numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="blk.0.attn_q_norm.weight"):
        load_model(path)
