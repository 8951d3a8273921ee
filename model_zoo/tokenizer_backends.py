"""The two engines behind model_zoo.Tokenizer: HF `tokenizers` and `sentencepiece`.

Both expose the same small surface: encode text (special tokens recognised, nothing added), decode ids,
look pieces up. BOS/EOS rules live in Tokenizer, not here.
"""

from __future__ import annotations

import re
from typing import Sequence

import sentencepiece
import tokenizers


class HFBackend:
    """A `tokenizers.Tokenizer` (tokenizer.json, a GGUF BPE vocabulary, or the byte fallback)."""

    def __init__(self, tok: tokenizers.Tokenizer):
        self.tok = tok
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, post_process: bool = False) -> list[int]:
        # post_process=True lets tokenizer.json's own post-processor add BOS/EOS
        return self.tok.encode(text, add_special_tokens=post_process).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_text(self, i: int) -> str:
        text = self.tok.decode([i], skip_special_tokens=False)
        return self.piece(i) or "" if "\ufffd" in text else text

    def piece_id(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece)


class SentencePieceBackend:
    """A SentencePiece model; control tokens written in the text (e.g. "<s>") are split out first.

    Each run of plain text is encoded on its own, so it gets the dummy-prefix space after a special token,
    as Meta's LLaMA code, llama.cpp and transformers' legacy LLaMA tokenizer all do.
    """

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        n = self.sp.get_piece_size()
        self.special_ids = frozenset(i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i))
        specials = sorted((self.sp.id_to_piece(i) for i in self.special_ids), key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, post_process: bool = False) -> list[int]:
        if self._special_re is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for k, part in enumerate(self._special_re.split(text)):
            if k % 2:  # odd parts are the captured special tokens
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        out, run = [], []
        for i in ids + [None]:
            if i is not None and i not in self.special_ids:
                run.append(i)
                continue
            if run:
                text = self.sp.decode(run)
                # sentencepiece drops the leading space of every decode call; keep it after a special token
                if out and self.sp.id_to_piece(run[0]).startswith("\u2581"):
                    text = " " + text
                out.append(text)
                run = []
            if i is not None:
                out.append(self.sp.id_to_piece(i))
        return "".join(out)

    def piece(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def token_text(self, i: int) -> str:
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):
            text = self.sp.decode([i])
            return piece if "\ufffd" in text else text
        return piece if i in self.special_ids else piece.replace("\u2581", " ")

    def piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        # piece_to_id answers unk_id for unknown pieces
        return i if self.sp.id_to_piece(i) == piece else None
