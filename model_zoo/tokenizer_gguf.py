"""Rebuilding a tokenizer from the vocabulary stored in GGUF metadata.

tokenizer.ggml.model "gpt2": byte-level BPE (tokens + merges) on HF `tokenizers`, with the pre-tokenizer that
tokenizer.ggml.pre names (llama.cpp's table). "llama": a SentencePiece BPE model rebuilt from pieces, scores
and types. Token type CONTROL marks special tokens, matched whole when they appear in text.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.sentencepiece_proto import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, SpmSpec, serialize_model_proto
from model_zoo.tokenizer_backends import HFBackend, SentencePieceBackend

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> how text is split before BPE (the names llama.cpp's converter writes)
_GPT2_REGEX = ("default", "gpt-2", "gpt2", "olmo", "jais")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3 = ("llama3", "llama-bpe", "llama-v3", "smaug-bpe")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")


def gguf_backend(meta: Mapping[str, Any]) -> tuple[HFBackend | SentencePieceBackend, bool, bool]:
    """(backend, add_bos, add_eos) for the tokenizer.ggml.* fields of a GGUF file."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelSourceError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        backend, default_bos = HFBackend(_byte_level_bpe(meta)), False
    elif kind == "llama":
        backend, default_bos = _sentencepiece(meta), True
    else:
        raise ModelSourceError(f"unsupported GGUF tokenizer model {kind!r}: fllama reads 'gpt2' (BPE) and 'llama' "
                               "(SentencePiece) vocabularies")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return backend, add_bos, add_eos


def _byte_level_bpe(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise CorruptCheckpointError("the GGUF BPE vocabulary has no merges (tokenizer.ggml.merges)")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, tokens, types)
    if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B", special_tokens=[(tokens[bos_id], bos_id)])
    return tok


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3 or pre in _QWEN2:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT if pre in _LLAMA3 else QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _GPT2_REGEX:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting text with the GPT-2 rule", stacklevel=3)
    return byte_level


def _add_typed_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens (both matched whole)."""
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _sentencepiece(meta: Mapping[str, Any]) -> SentencePieceBackend:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    # sentencepiece insists on exactly one UNKNOWN piece and on BOS/EOS being control pieces
    types[unk] = UNKNOWN
    for i in (bos, eos):
        if types[i] == NORMAL:
            types[i] = CONTROL
    spec = SpmSpec(pieces=tokens, scores=scores, types=types, unk_id=unk, bos_id=bos, eos_id=eos,
                   add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                   remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)))
    try:
        return SentencePieceBackend(serialize_model_proto(spec))
    except (RuntimeError, ValueError) as e:
        raise CorruptCheckpointError(f"the GGUF SentencePiece vocabulary is inconsistent ({e})") from None

