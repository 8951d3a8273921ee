"""TMA tensor maps (cuTensorMapEncodeTiled, reached with ctypes as launch_ex.py reaches the driver), kept in
device memory for kernels that take a pointer to one.

Why device memory: a kernel can take its map as a 128-byte `__grid_constant__` parameter, but build.py's
launchers pass pointers and scalars only (PyCUDA's prepared calls and launch_ex's packed buffers); the TMA
instruction accepts a map's generic address in global memory as well. A map depends only on the tensor's
address, shape and the box, so one uploaded map serves every later call on the same buffer: `device_map`
keeps them in a small LRU keyed by exactly those. The upload is an ordinary copy on the current stream, ahead
of the kernel that reads it. Inside CUDA-graph capture (the engine's prefill graphs) a copy from host memory
cannot be captured, so the map goes into device memory through `put_map` (tensor_map.cu), a kernel whose
parameters are the map's 16 words: captured by value, rewritten by every replay ahead of its GEMM. A map
written by a kernel's (generic-proxy) stores reaches the TMA unit only through a tensormap-proxy acquire in the
kernel that uses it (awq_wgmma.cu, before its first copy): without one, a replay read stale maps wherever the
capture had given several GEMMs' maps one address in turn.
"""

from __future__ import annotations

import ctypes
import struct
from collections import OrderedDict

import torch

from kernels_cu import launch_ex

# cuda.h enums
DATA_TYPE = {torch.float16: 6, torch.bfloat16: 9, torch.float32: 7, torch.uint8: 0, torch.int8: 0}
INTERLEAVE_NONE = 0
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CU_TENSOR_MAP_SWIZZLE_*
L2_PROMOTION_256B = 3
OOB_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros
MAP_BYTES = 128
CACHE_SIZE = 256

_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def encode_2d(t: torch.Tensor, box_cols: int, box_rows: int, swizzle: int = 128) -> bytes:
    """The map of a row-major 2D CUDA tensor [rows, cols] read in boxes of box_rows x box_cols elements."""
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"a 2D tensor map needs a contiguous 2D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in DATA_TYPE:
        raise ValueError(f"no tensor map data type for {t.dtype}")
    rows, cols = t.shape
    esize = t.element_size()
    if (cols * esize) % 16 or t.data_ptr() % 16:
        raise ValueError(f"a tensor map needs 16-byte aligned rows and base (cols={cols}, {t.dtype})")
    if swizzle and box_cols * esize > swizzle:
        raise ValueError(f"a {swizzle}-byte swizzle takes boxes of at most {swizzle} bytes a row")
    fn = launch_ex._lib().cuTensorMapEncodeTiled  # argtypes set once there
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    out = (ctypes.c_uint8 * MAP_BYTES)()
    dims = (u64 * 2)(cols, rows)
    strides = (u64 * 1)(cols * esize)
    box = (u32 * 2)(box_cols, box_rows)
    ones = (u32 * 2)(1, 1)
    rc = fn(ctypes.addressof(out), DATA_TYPE[t.dtype], 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box, ones,
            INTERLEAVE_NONE, SWIZZLE[swizzle], L2_PROMOTION_256B, OOB_FILL_ZERO)
    launch_ex._check(rc, f"cuTensorMapEncodeTiled ({rows}x{cols} {t.dtype}, box {box_rows}x{box_cols})")
    return bytes(out)


def device_map(t: torch.Tensor, box_cols: int, box_rows: int, swizzle: int = 128) -> torch.Tensor:
    """The map of `t` (encode_2d) in device memory: a 128-byte uint8 tensor to pass as a pointer."""
    if torch.cuda.is_current_stream_capturing():
        # In the graph's private pool, which keeps the block for the graph's replays after this tensor is gone. Not
        # cached: it holds the map only once a replay has run put_map, and an eager caller must not see it before.
        # Nor taken from the cache: an eager map there may be dropped (and its block reused) while the graph lives.
        m = torch.empty(MAP_BYTES, dtype=torch.uint8, device=t.device)
        _put_map(m, encode_2d(t, box_cols, box_rows, swizzle))
        return m
    key = (t.device.index, t.data_ptr(), tuple(t.shape), t.dtype, box_cols, box_rows, swizzle)
    m = _cache.get(key)
    if m is not None:
        _cache.move_to_end(key)
        return m
    raw = encode_2d(t, box_cols, box_rows, swizzle)
    m = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(t.device)  # 256-byte aligned (a map needs 64)
    _put_map_kernel()  # built and loaded now: a capture later must not load a module
    _cache[key] = m
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return m


def _put_map(m: torch.Tensor, raw: bytes) -> None:
    """raw (a map's 128 bytes) into device memory m by a kernel launch on the current (capturing) stream."""
    _put_map_kernel()((1,), (32,), m, *struct.unpack("<16Q", raw))


def _put_map_kernel():
    from kernels_cu import build

    return build.get_function("tensor_map.cu", "put_map", "P" + "Q" * 16)
