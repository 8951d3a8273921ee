"""Tokenizer: text <-> ids with the model's own BOS/EOS rules, streaming decode, and its chat template text.

Sources: an HF directory (tokenizer.json through `tokenizers`, or tokenizer.model through `sentencepiece`),
the vocabulary inside a GGUF file (model_zoo.tokenizer_gguf), or a byte-level fallback for random-weight
presets (ids 0..2 = <unk>/<s>/</s>, byte b at id 3 + b, the rest unused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import gguf
import tokenizers
from tokenizers import AddedToken, decoders, models, processors

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.gguf_meta import GGUFFile, read_gguf, read_metadata
from model_zoo.tokenizer_backends import HFBackend, SentencePieceBackend
from model_zoo.tokenizer_gguf import gguf_backend

# Tokens that end a turn in common chat formats; when present as special tokens they also stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                      "<end_of_turn>", "<|end|>")
# EOS spellings tried when no config file names the EOS token
COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BYTE_OFFSET = 3  # byte_fallback: <unk>, <s>, </s> come first


class Tokenizer:
    def __init__(self, backend: HFBackend | SentencePieceBackend, *, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool = False, chat_template: str | None = None,
                 extra_eos_ids: Sequence[int] = (), kind: str = ""):
        self._backend = backend
        self.kind = kind or type(backend).__name__  # where it came from, for `fllama info`
        self.vocab_size = backend.vocab_size
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.chat_template = chat_template
        turn_ends = (backend.piece_id(t) for t in END_OF_TURN_TOKENS)
        ends = {eos_id, *extra_eos_ids, *(i for i in turn_ends if i in backend.special_ids)}
        self.eos_ids = frozenset(i for i in ends if i is not None)

    # --- text <-> ids -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> "StreamDecoder":
        """Incremental detokenizer; `context` (e.g. the prompt's last ids) gets the first word's spacing right."""
        return StreamDecoder(self, skip_special_tokens, context)

    def token_text(self, i: int) -> str:
        """The text of one token, for display; a lone partial UTF-8 byte shows as its piece (e.g. <0xE2>)."""
        if not 0 <= i < self.vocab_size:
            raise IndexError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return self._backend.token_text(i)

    def token_to_id(self, piece: str) -> int | None:
        return self._backend.piece_id(piece)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._backend.special_ids

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self._backend.piece(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self._backend.piece(self.eos_id)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, add_bos={self.add_bos})")

    # --- files ----------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> list[Path]:
        """Write tokenizer files an HF directory carries (tokenizer.json or tokenizer.model + config)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cfg: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                               "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
                               "chat_template": self.chat_template}
        if isinstance(self._backend, SentencePieceBackend):
            written = d / "tokenizer.model"
            written.write_bytes(self._backend.model_proto)
            cfg.update(tokenizer_class="LlamaTokenizer", legacy=True, unk_token=self._backend.piece(0))
        else:
            written = d / "tokenizer.json"
            self._backend.tok.save(str(written))
            cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        return [written, d / "tokenizer_config.json"]

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json (preferred) or tokenizer.model, with tokenizer_config.json's BOS/EOS rules."""
        d = Path(path)
        tok_cfg = _read_json(d / "tokenizer_config.json")
        if (d / "tokenizer.json").is_file():
            return _from_tokenizer_json(d, tok_cfg)
        if (d / "tokenizer.model").is_file():
            return _from_sentencepiece_file(d, tok_cfg)
        raise ModelSourceError(f"{d} has no tokenizer.json or tokenizer.model")

    @classmethod
    def from_gguf(cls, source: GGUFFile | gguf.GGUFReader | Mapping[str, Any] | str | Path) -> "Tokenizer":
        """From a GGUF path, a read file (model_zoo.gguf_meta), a gguf.GGUFReader, or decoded metadata."""
        if isinstance(source, (str, Path)):
            source = read_gguf(source)
        if isinstance(source, GGUFFile):
            meta = source.meta
        else:
            meta = read_metadata(source) if isinstance(source, gguf.GGUFReader) else source
        backend, add_bos, add_eos = gguf_backend(meta)
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(backend, bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
                   eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")), add_bos=add_bos, add_eos=add_eos,
                   chat_template=meta.get("tokenizer.chat_template"), extra_eos_ids=extra,
                   kind=f"gguf {meta.get('tokenizer.ggml.model')}")

    @classmethod
    def byte_fallback(cls, vocab_size: int) -> "Tokenizer":
        """UTF-8 bytes as tokens (3 + byte), BOS added; for presets with random weights and no vocabulary."""
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"byte_fallback needs vocab_size >= {BYTE_OFFSET + 256}, got {vocab_size}")
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"<0x{b:02X}>": BYTE_OFFSET + b for b in range(256)})
        # the ids a random model may still emit decode to visible placeholders
        vocab.update({f"<unused{i}>": i for i in range(BYTE_OFFSET + 256, vocab_size)})
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", 1)])
        return cls(HFBackend(tok), bos_id=1, eos_id=2, add_bos=True, kind="byte fallback")


class StreamDecoder:
    """Turns generated ids into text as they come, never emitting half a UTF-8 character.

    Decodes a short window of ids and emits what it adds beyond the text already emitted for the same window;
    decoding in context keeps the spaces that tokenizers strip at the start of a decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids = [int(i) for i in context]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if not final and (text.endswith("\ufffd") or len(text) <= len(done)):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


def _from_tokenizer_json(d: Path, tok_cfg: dict) -> Tokenizer:
    try:
        backend = HFBackend(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON or unknown components
        raise CorruptCheckpointError(f"{d / 'tokenizer.json'} cannot be read ({e})") from None
    bos_id, eos_id, extra_eos = _special_ids(d, tok_cfg, backend)
    # without explicit flags, the post-processor in tokenizer.json says whether BOS/EOS are added
    added = backend.encode("", post_process=True)
    if bos_id is None and added[:1] and added[0] in backend.special_ids:
        bos_id = added[0]  # no config names BOS: the token the post-processor puts first
    if eos_id is None:
        eos_id = next((i for i in map(backend.piece_id, COMMON_EOS) if i in backend.special_ids), None)
    post_bos = bos_id is not None and added[:1] == [bos_id]
    post_eos = eos_id is not None and added[int(post_bos):][-1:] == [eos_id]
    add_bos = tok_cfg.get("add_bos_token", post_bos)
    add_eos = tok_cfg.get("add_eos_token", post_eos)
    return Tokenizer(backend, bos_id=bos_id, eos_id=eos_id, add_bos=bool(add_bos), add_eos=bool(add_eos),
                     chat_template=_chat_template(d, tok_cfg), extra_eos_ids=extra_eos, kind="tokenizer.json")


def _from_sentencepiece_file(d: Path, tok_cfg: dict) -> Tokenizer:
    try:
        backend = SentencePieceBackend((d / "tokenizer.model").read_bytes())
    except (RuntimeError, OSError) as e:
        raise CorruptCheckpointError(f"{d / 'tokenizer.model'} cannot be read ({e})") from None
    bos_id, eos_id, extra_eos = _special_ids(d, tok_cfg, backend)
    bos_id = backend.sp.bos_id() if bos_id is None and backend.sp.bos_id() >= 0 else bos_id
    eos_id = backend.sp.eos_id() if eos_id is None and backend.sp.eos_id() >= 0 else eos_id
    return Tokenizer(backend, bos_id=bos_id, eos_id=eos_id, add_bos=bool(tok_cfg.get("add_bos_token", True)),
                     add_eos=bool(tok_cfg.get("add_eos_token", False)), chat_template=_chat_template(d, tok_cfg),
                     extra_eos_ids=extra_eos, kind="sentencepiece")


def _special_ids(d: Path, tok_cfg: dict, backend) -> tuple[int | None, int | None, list[int]]:
    """BOS/EOS ids from tokenizer_config.json, special_tokens_map.json, then config.json; extra EOS ids."""
    special_map = _read_json(d / "special_tokens_map.json")
    model_cfg = _read_json(d / "config.json")
    gen_cfg = _read_json(d / "generation_config.json")

    def lookup(name: str) -> int | None:
        content = _token_content(tok_cfg.get(name, special_map.get(name)))
        i = backend.piece_id(content) if content else None
        return i if i is not None else _opt_int(model_cfg.get(name + "_id"))

    extra = [i for src in (model_cfg, gen_cfg) for i in _as_list(src.get("eos_token_id"))]
    return lookup("bos_token"), lookup("eos_token"), extra


def _chat_template(d: Path, tok_cfg: dict) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    template = tok_cfg.get("chat_template") or _read_json(d / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _opt_int(v: Any) -> int | None:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)
