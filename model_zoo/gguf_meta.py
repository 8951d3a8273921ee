"""Reading GGUF files: key/value metadata as plain Python values, tensors as raw numpy views.

read_gguf parses the header itself: gguf.GGUFReader builds a numpy memmap object per array element, which
takes seconds for a 49k-token vocabulary (tokens, merges, types), while this reads it in ~0.1 s. The layout
it reads is GGUF v2/v3 little-endian; tests check it against GGUFReader field by field and tensor by tensor.
Tensor data come back shaped as GGUFReader shapes them, ready for gguf.quants.dequantize.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from model_zoo.errors import CorruptCheckpointError, ModelSourceError

V = gguf.GGUFValueType
_SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
_NUMPY = {V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16, V.UINT32: np.uint32,
          V.INT32: np.int32, V.FLOAT32: np.float32, V.BOOL: np.bool_, V.UINT64: np.uint64, V.INT64: np.int64,
          V.FLOAT64: np.float64}
Q = gguf.GGMLQuantizationType
# tensor types GGUFReader exposes as typed elements; every other type is raw bytes [rows, bytes per row]
_TYPED = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
          Q.I32: np.int32, Q.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (columns) first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # [rows, cols] elements, or [rows, bytes] for block-quantized types; read-only view


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    meta: dict[str, Any]
    tensors: list[GGUFTensor]

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata and tensor views of a GGUF file; CorruptCheckpointError for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ModelSourceError(f"no such file or directory: {path}")
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise CorruptCheckpointError(f"{path} is not a GGUF file (it is empty)") from None
    try:
        return _parse(path, buf)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, KeyError) as e:
        raise CorruptCheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The same metadata dict from a gguf.GGUFReader (used by tests and by callers holding a reader)."""
    meta = {}
    for key, field in reader.fields.items():
        kind = field.types[0]
        if kind == V.ARRAY:
            if len(field.types) != 2:
                continue
            if field.types[1] == V.STRING:
                meta[key] = [field.parts[i].tobytes().decode("utf-8") for i in field.data]
            else:
                meta[key] = np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
        elif kind == V.STRING:
            meta[key] = field.parts[field.data[0]].tobytes().decode("utf-8")
        else:
            meta[key] = field.parts[field.data[0]][0].item()
    return meta


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        kind = V(kind)
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            return self.scalar(_SCALARS[kind])
        elem, n = V(self.scalar("<I")), self.scalar("<Q")
        if elem in _NUMPY:
            arr = np.frombuffer(self.buf, dtype=_NUMPY[elem], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self.value(elem) for _ in range(n)]


def _parse(path: Path, buf: mmap.mmap) -> GGUFFile:
    cur = _Cursor(buf)
    if len(buf) < 24 or cur.scalar("<I") != gguf.GGUF_MAGIC:
        raise CorruptCheckpointError(f"{path} is not a GGUF file (bad magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise CorruptCheckpointError(f"{path}: GGUF version {version} is not supported (2 and 3 are; "
                                     "a huge number means a big-endian file)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append((name, dims, Q(cur.scalar("<I")), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    return GGUFFile(path, meta, [_tensor(path, data, start, *info) for info in infos])


def _tensor(path: Path, data: np.ndarray, start: int, name: str, dims: tuple[int, ...], qtype: Q,
            offset: int) -> GGUFTensor:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_elems = int(np.prod(dims)) if dims else 1
    n_bytes = n_elems * type_size // block
    begin = start + offset
    if begin + n_bytes > len(data):
        raise CorruptCheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
    raw = data[begin:begin + n_bytes]
    np_dims = tuple(reversed(dims))  # [rows, cols]
    if qtype in _TYPED:
        arr = raw.view(_TYPED[qtype]).reshape(np_dims)
    else:
        arr = raw.reshape(gguf.quants.quant_shape_to_byte_shape(np_dims, qtype))
    return GGUFTensor(name, dims, qtype, arr)
