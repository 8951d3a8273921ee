"""A SentencePiece model (the protobuf `ModelProto`) serialized by hand from a GGUF 'llama' vocabulary.

GGUF stores a SentencePiece vocabulary as pieces + scores + piece types. Rebuilding the original model
proto lets the `sentencepiece` library itself do the encoding, so GGUF and tokenizer.model sources tokenize
identically. The proto is written with the wire format directly because `protobuf` is not a dependency.
Field numbers are those of sentencepiece_model.proto.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

# SentencePiece piece types; GGUF's tokenizer.ggml.token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPE_BPE = 2


@dataclass(frozen=True)
class SpmSpec:
    pieces: Sequence[str]
    scores: Sequence[float]
    types: Sequence[int]
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = False

    def __post_init__(self) -> None:
        if not (len(self.pieces) == len(self.scores) == len(self.types)):
            raise ValueError(f"pieces, scores and types differ in length: "
                             f"{len(self.pieces)}, {len(self.scores)}, {len(self.types)}")


def serialize_model_proto(spec: SpmSpec) -> bytes:
    """The bytes of a BPE ModelProto that SentencePieceProcessor(model_proto=...) accepts."""
    pieces = b"".join(_message(1, _string(1, p) + _float(2, s) + _varint_field(3, t))
                      for p, s, t in zip(spec.pieces, spec.scores, spec.types))
    byte_fallback = any(t == BYTE for t in spec.types)
    trainer = (_varint_field(3, MODEL_TYPE_BPE) + _varint_field(4, len(spec.pieces))
               + _varint_field(35, int(byte_fallback)) + _varint_field(40, spec.unk_id)
               + _varint_field(41, spec.bos_id) + _varint_field(42, spec.eos_id) + _varint_field(43, spec.pad_id))
    normalizer = (_string(1, "identity") + _varint_field(3, int(spec.add_dummy_prefix))
                  + _varint_field(4, int(spec.remove_extra_whitespaces)) + _varint_field(5, 1))
    return pieces + _message(2, trainer) + _message(3, normalizer)


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int32 values are sent as 10-byte two's complement varints
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        if v:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _varint_field(field: int, v: int) -> bytes:
    return _key(field, 0) + _varint(v)


def _float(field: int, v: float) -> bytes:
    return _key(field, 5) + struct.pack("<f", v)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _string(field: int, s: str) -> bytes:
    return _bytes(field, s.encode("utf-8"))


def _message(field: int, body: bytes) -> bytes:
    return _bytes(field, body)
