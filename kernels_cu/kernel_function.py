"""A compiled kernel with a declared argument signature, launched async on fllama's stream (cuda_context.py).

Signatures are declared, one character per kernel argument (pycuda struct codes, native alignment):
    P  pointer   (torch.Tensor on the GPU -> its data_ptr; int -> raw address; None -> nullptr)
    i  int32     I  uint32     q  int64     Q  uint64     f  float32

Inside `with programmatic():` (the engine's calls) launches go through launch_ex.py's cuLaunchKernelEx with
programmatic dependent launch on Hopper: each kernel may start while the previous one finishes (every kernel waits
in `pdl_wait()` before it reads what the previous one wrote). FLLAMA_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from kernels_cu.cuda_context import current_stream_handle, one_line, stream
from model_zoo.errors import DeviceError

SIGNATURE_CODES = frozenset("PiIqQf")
STATIC_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory

_local = threading.local()


def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, and not turned off with FLLAMA_PDL=0."""
    if os.environ.get("FLLAMA_PDL", "1") == "0":
        return False
    return _hopper_or_newer()


@functools.lru_cache(maxsize=1)
def _hopper_or_newer() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


@contextmanager
def programmatic() -> Iterator[None]:
    """Launches in this block (this thread) use programmatic dependent launch where supported.

    Only for code whose kernels read no weights written by the kernel just before them: a kernel's
    prologue loads its weights before it waits for the previous kernel (the engine's weights are written
    and synchronized at load, so its forward qualifies)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def programmatic_active() -> bool:
    return getattr(_local, "depth", 0) > 0 and pdl_supported()


class KernelFunction:
    """A compiled kernel with a declared argument signature, launched async on fllama's stream."""

    def __init__(self, fn, name: str, signature: str, cubin: str):
        bad = set(signature) - SIGNATURE_CODES
        if bad:
            raise ValueError(f"{name}: unknown signature codes {sorted(bad)} (use {''.join(sorted(SIGNATURE_CODES))})")
        self._fn = fn.prepare(signature)
        self._convs = fast_converters(signature)
        self.name = name
        self.signature = signature
        self._cubin = cubin  # loaded a second time by launch_ex for programmatic launches
        self._ex = None  # launch_ex.ExLauncher, made on the first programmatic or cluster launch
        self._ex_large_clusters = False
        self.programmatic_launches = 0
        self.cluster_launches = 0
        self._stream = stream()
        self._stream_handle = int(self._stream.handle)
        self._device_index = torch.cuda.current_device()  # fllama's one context and stream live on it
        self._max_dynamic_shared = STATIC_SHARED_LIMIT
        self._ex_max_dynamic_shared = STATIC_SHARED_LIMIT
        self._sync_each = os.environ.get("FLLAMA_CUDA_SYNC") == "1"  # debugging: surface async faults here

    def resources(self) -> dict[str, int]:
        """What the compiled kernel costs each thread / block: registers, local (spill) bytes, static shared bytes."""
        import pycuda.driver as drv

        attr = drv.function_attribute
        return {"registers": self._fn.get_attribute(attr.NUM_REGS),
                "local_bytes": self._fn.get_attribute(attr.LOCAL_SIZE_BYTES),
                "shared_bytes": self._fn.get_attribute(attr.SHARED_SIZE_BYTES)}

    def __call__(self, grid: tuple, block: tuple, *args, shared: int = 0, cluster: tuple | None = None) -> None:
        """cluster: thread-block cluster dimensions (each must divide the grid's), launched through
        cuLaunchKernelEx (launch_ex.py) since cuLaunchKernel has no way to pass them; needs sm_90."""
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments ({self.signature}), got {len(args)}")
        if current_stream_handle(self._device_index) != self._stream_handle:
            # A launch off torch's current stream would race with the torch ops that made its inputs.
            raise RuntimeError(f"{self.name}: launch inside `with kernels_cu.build.on_stream():`")
        packed = _pack_args(self._convs, self.signature, self.name, args)
        if shared > self._max_dynamic_shared:
            import pycuda.driver as drv
            self._fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
            self._max_dynamic_shared = shared
        try:
            pdl = programmatic_active()
            if pdl or cluster is not None:
                self._launch_ex(_dim3(grid), _dim3(block), packed, shared, pdl,
                                None if cluster is None else _dim3(cluster))
            else:
                self._fn.prepared_async_call(_dim3(grid), _dim3(block), self._stream, *packed, shared_size=shared)
            if self._sync_each:
                self._stream.synchronize()
        except DeviceError:  # launch_ex's, already naming the kernel
            raise
        except Exception as e:  # pycuda.driver.LaunchError / LogicError
            raise DeviceError(f"kernel {self.name} grid={grid} block={block}: {one_line(e)}") from None

    def _prepare_ex(self, shared: int, cluster: tuple[int, int, int] | None):
        """The cuLaunchKernelEx launcher, its function handle given the shared memory and cluster size asked."""
        from kernels_cu import launch_ex

        if self._ex is None:
            self._ex = launch_ex.ExLauncher(launch_ex.load_function(self._cubin, self.name), self.name,
                                            self.signature)
        if shared > self._ex_max_dynamic_shared:  # the attribute belongs to each function handle
            launch_ex.set_max_dynamic_shared(self._ex.fn, shared)
            self._ex_max_dynamic_shared = shared
        if cluster is not None and cluster[0] * cluster[1] * cluster[2] > launch_ex.PORTABLE_CLUSTER \
                and not self._ex_large_clusters:
            launch_ex.allow_large_clusters(self._ex.fn)
            self._ex_large_clusters = True
        return self._ex

    def _launch_ex(self, grid: tuple[int, int, int], block: tuple[int, int, int], packed: list, shared: int,
                   pdl: bool, cluster: tuple[int, int, int] | None) -> None:
        self._prepare_ex(shared, cluster)(grid, block, self._stream_handle, shared, packed, pdl, cluster)
        self.programmatic_launches += pdl
        self.cluster_launches += cluster is not None

    @functools.lru_cache(maxsize=256)  # noqa: B019 (a few launch shapes per kernel, kernels live for the process)
    def max_active_clusters(self, grid: tuple, block: tuple, shared: int, cluster: tuple) -> int:
        """How many clusters of this launch shape the GPU holds at once (cuOccupancyMaxActiveClusters)."""
        from kernels_cu import launch_ex

        grid, block, cluster = _dim3(grid), _dim3(block), _dim3(cluster)
        fn = self._prepare_ex(shared, cluster).fn
        try:
            return launch_ex.max_active_clusters(fn, grid, block, shared, cluster)
        except DeviceError as e:
            raise DeviceError(f"kernel {self.name}: {e}") from None

    @property
    def num_regs(self) -> int:
        return self._fn.num_regs


_DIM3: dict[tuple, tuple[int, int, int]] = {}  # the launches' grids and blocks, checked once each


def _dim3(d: tuple) -> tuple[int, int, int]:
    try:
        hit = _DIM3.get(d)
    except TypeError:  # a list
        hit = None
    if hit is not None:
        return hit
    out = tuple(int(x) for x in d)
    if not 1 <= len(out) <= 3 or min(out) < 1:
        raise ValueError(f"launch dimensions must be 1 to 3 positive ints, got {out}")
    out += (1,) * (3 - len(out))
    if isinstance(d, tuple) and len(_DIM3) < 65536 and all(type(x) is int for x in d):
        _DIM3[d] = out
    return out


def _fast_ptr(a: Any) -> int:
    """'P' for a GPU tensor or None; raises for anything else, which _pack_arg then converts or names."""
    if a is None:
        return 0
    if isinstance(a, torch.Tensor) and a.is_cuda:
        return a.data_ptr()
    raise ValueError("not a GPU tensor")


def _fast_int(a: Any) -> int:
    if type(a) is int:
        return a
    raise TypeError("not an int")


def _refuse(a: Any) -> Any:
    raise TypeError("no fast conversion")


_FAST_CONVERT = {"P": _fast_ptr, "f": float, "i": _fast_int, "I": _fast_int, "q": _fast_int, "Q": _fast_int}


def fast_converters(signature: str) -> tuple:
    return tuple(_FAST_CONVERT.get(code, _refuse) for code in signature)


def _pack_args(convs: tuple, signature: str, name: str, args: tuple) -> list:
    """The launch's argument values: the common ones (GPU tensors, None, ints, floats) without _pack_arg's
    bookkeeping, which is a launch's largest host cost after the driver call; anything else, or a bad argument,
    through _pack_arg, which converts it or names it."""
    try:
        return [conv(a) for conv, a in zip(convs, args)]
    except Exception:
        return [_pack_arg(code, a, name, i) for i, (code, a) in enumerate(zip(signature, args))]


def _pack_arg(code: str, a: Any, name: str, i: int):
    if code == "P":
        if isinstance(a, torch.Tensor):
            if not a.is_cuda:
                raise ValueError(f"{name} argument {i}: tensor is on {a.device}, not the GPU")
            return a.data_ptr()
        if a is None:
            return 0
        return int(a)
    if code == "f":
        return float(a)
    if isinstance(a, bool) or not isinstance(a, int):
        try:
            import numpy as np
            if isinstance(a, np.integer):
                return int(a)
        except ImportError:
            pass
        raise TypeError(f"{name} argument {i}: expected an int for code {code!r}, got {type(a).__name__}")
    return a
