"""Programmatic dependent launch (PDL) and thread-block clusters through the driver's cuLaunchKernelEx,
reached with ctypes.

Why: a decode step is ~300 kernels, most of them a few microseconds long, and between two kernels of a
stream the GPU drains the first completely before the second starts (its blocks then wait for their
first DRAM loads). Launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, a kernel may
start while the one before it finishes: our kernels issue the weight loads of their first step, then
`griddepcontrol.wait` (common.cuh, pdl_wait) until the previous grid is complete and visible. The
attribute is kept by stream capture, so the CUDA graph of a decode step has programmatic edges.

PyCUDA (2026.1) launches with cuLaunchKernel only and does not expose its CUfunction handles, so this
module loads the same cubin a second time with cuModuleLoad into the same (primary) context and launches
with cuLaunchKernelEx; the arguments go in one packed buffer (CU_LAUNCH_PARAM_BUFFER_POINTER), packed with
native alignment as PyCUDA packs them. build.py decides when to use it (see build.programmatic): for every
launch inside `programmatic()`, and for every launch with cluster dimensions (CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
which cuLaunchKernel cannot pass), PDL or not.
"""

from __future__ import annotations

import ctypes
import struct
import threading

from model_zoo.errors import DeviceError

# cuda.h (CUDA 12.3+, same values in 13.0)
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5
CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING = 2
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER = 8  # blocks per cluster every sm_90 part runs; more needs the non-portable attribute
CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an enum id padded to 8 bytes, then a 64-byte value union: an int (PDL) in `value`,
    or clusterDim's three unsigned ints in `value`, `y`, `z`."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint),
                ("y", ctypes.c_uint), ("z", ctypes.c_uint), ("value_pad", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def arg_format(signature: str) -> str:
    """build.py's signature codes are struct codes; '@' packs them with C's alignment (as PyCUDA does)."""
    return "@" + signature


_lock = threading.Lock()
_state: dict = {}


def _lib() -> ctypes.CDLL:
    with _lock:
        if "lib" not in _state:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise DeviceError(f"cannot load the CUDA driver library: {e}") from None
            lib.cuModuleLoad.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
            lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
            lib.cuModuleGetGlobal_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.c_void_p, ctypes.c_char_p]
            lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_void_p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                         ctypes.POINTER(LaunchConfig)]
            u64, u32, i32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int  # tensor_map.encode_2d
            lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, i32, u32, ctypes.c_void_p, ctypes.POINTER(u64),
                                                   ctypes.POINTER(u64), ctypes.POINTER(u32), ctypes.POINTER(u32),
                                                   i32, i32, i32, i32]
            _state["lib"] = lib
            _state["modules"] = {}
        return _state["lib"]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(rc, ctypes.byref(msg))
        raise DeviceError(f"{what}: {(msg.value or b'CUDA error').decode()} ({rc})")


def load_function(cubin: str, name: str) -> int:
    """The CUfunction `name` of the cubin file, loaded (once per file) into the current context."""
    lib = _lib()
    with _lock:
        modules = _state["modules"]
        if cubin not in modules:
            mod = ctypes.c_void_p()
            _check(lib.cuModuleLoad(ctypes.byref(mod), cubin.encode()), f"cuModuleLoad {cubin}")
            modules[cubin] = mod
        fn = ctypes.c_void_p()
        _check(lib.cuModuleGetFunction(ctypes.byref(fn), modules[cubin], name.encode()), f"cuModuleGetFunction {name}")
        return fn.value


def module_global(cubin: str, name: str) -> tuple[int, int] | None:
    """(device pointer, bytes) of the `__device__` variable `name` in this module's copy of the cubin (its
    globals are not PyCUDA's), or None while no kernel of it was launched here (timing probes read it)."""
    lib = _lib()
    with _lock:
        mod = _state["modules"].get(cubin)
    if mod is None:
        return None
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod, name.encode()),
           f"cuModuleGetGlobal {name}")
    return ptr.value, size.value


def set_max_dynamic_shared(fn: int, nbytes: int) -> None:
    _check(_lib().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
           "cuFuncSetAttribute")


def _cluster_attrs(attrs, n: int, cluster: tuple[int, int, int]) -> int:
    """Cluster dimensions and the load-balancing placement into attrs[n], attrs[n + 1] -> the new count.

    Why load balancing: under the default (spread) placement an H200 holds only 28 clusters of 12 decode-attention
    blocks (71 KB of shared memory each) at a time, 30 with it; and 124 against 132 clusters of 3 (H200, measured
    with cuOccupancyMaxActiveClusters). A grid that needs one more cluster than fits runs a second wave."""
    a = attrs[n]
    a.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    a.value, a.y, a.z = cluster
    b = attrs[n + 1]
    b.id, b.value, b.y, b.z = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE, CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING, 0, 0
    return n + 2


def max_active_clusters(fn: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
                        cluster: tuple[int, int, int]) -> int:
    """cuOccupancyMaxActiveClusters: how many clusters of this launch the GPU holds at once."""
    lib = _lib()
    attrs = (LaunchAttribute * 2)()
    n = _cluster_attrs(attrs, 0, cluster)
    cfg = LaunchConfig(gridDimX=grid[0], gridDimY=grid[1], gridDimZ=grid[2], blockDimX=block[0], blockDimY=block[1],
                       blockDimZ=block[2], sharedMemBytes=shared,
                       attrs=ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), numAttrs=n)
    out = ctypes.c_int()
    _check(lib.cuOccupancyMaxActiveClusters(ctypes.byref(out), fn, ctypes.byref(cfg)), "cuOccupancyMaxActiveClusters")
    return out.value


def allow_large_clusters(fn: int) -> None:
    """Clusters of more than PORTABLE_CLUSTER blocks (up to 16 on H100 / H200) for this function."""
    _check(_lib().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
           "cuFuncSetAttribute (non-portable cluster size)")


class ExLauncher:
    """Launches one kernel through cuLaunchKernelEx with programmatic stream serialization and / or cluster
    dimensions.

    The config, attributes, argument buffer and `extra` array are made once and refilled per launch (the
    driver copies the arguments during the call), so a launch costs one pack_into and one ctypes call."""

    def __init__(self, fn: int, name: str, signature: str):
        self.fn = fn
        self.name = name
        self.signature = signature
        self._lib = _lib()
        self._fmt = struct.Struct(arg_format(signature))
        self._buf = ctypes.create_string_buffer(max(self._fmt.size, 1))
        self._size = ctypes.c_size_t(self._fmt.size)
        self._extra = (ctypes.c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self._buf),
                                            CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self._size),
                                            CU_LAUNCH_PARAM_END)
        self._attrs = (LaunchAttribute * 3)()
        self._cfg = LaunchConfig(attrs=ctypes.cast(self._attrs, ctypes.POINTER(LaunchAttribute)))
        self._cfg_ref = ctypes.byref(self._cfg)
        self._call_lock = threading.Lock()  # the buffers are shared between calls
        self._shape = None  # the launch shape the config holds now

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], stream: int, shared: int,
                 args: list, programmatic: bool = True, cluster: tuple[int, int, int] | None = None) -> None:
        shape = (grid, block, stream, shared, programmatic, cluster)
        with self._call_lock:
            self._fmt.pack_into(self._buf, 0, *args)
            if shape != self._shape:  # the config's ctypes fields are slow to set, and a launcher repeats its shapes
                n = 0
                if programmatic:
                    a = self._attrs[n]
                    a.id, a.value, a.y, a.z = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1, 0, 0
                    n += 1
                if cluster is not None:
                    n = _cluster_attrs(self._attrs, n, cluster)
                c = self._cfg
                c.numAttrs = n
                c.gridDimX, c.gridDimY, c.gridDimZ = grid
                c.blockDimX, c.blockDimY, c.blockDimZ = block
                c.sharedMemBytes = shared
                c.hStream = stream
                self._shape = shape
            rc = self._lib.cuLaunchKernelEx(self._cfg_ref, self.fn, None, self._extra)
        if rc != 0:
            _check(rc, f"kernel {self.name} grid={grid} block={block}")
