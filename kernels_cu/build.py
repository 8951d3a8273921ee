"""The PyCUDA build layer: the only code that compiles .cu files and talks to the CUDA driver.

- `get_function("rmsnorm.cu", "rmsnorm_f16", "PPPiif")` compiles kernels_cu/rmsnorm.cu once per process for
  the current device (sm_90a on Hopper), with the cubin cached on disk, and returns a `KernelFunction`.
- Every launch goes to ONE non-blocking stream owned by fllama (`stream()`); PyTorch sees it as
  `torch_stream()`, so engine torch ops run under `with on_stream():` and `torch.cuda.graph(g,
  stream=torch_stream())` captures PyCUDA launches and torch ops in one graph (measured on an H200).
- PyCUDA shares PyTorch's primary context (never pycuda.autoinit, which makes a second context).
- Inside `with programmatic():` (the engine's forward) launches go through launch_ex.py's cuLaunchKernelEx with
  programmatic dependent launch on Hopper: each kernel may start while the previous one finishes (every
  kernel waits in `pdl_wait()` before it reads what the previous one wrote). FLLAMA_PDL=0 turns it off.

Nothing here imports pycuda at module load: `import kernels_cu.*` works on CPU-only machines.

Signatures are declared, one character per kernel argument (pycuda struct codes, native alignment):
    P  pointer   (torch.Tensor on the GPU -> its data_ptr; int -> raw address; None -> nullptr)
    i  int32     I  uint32     q  int64     Q  uint64     f  float32
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from model_zoo.errors import DeviceError

KERNEL_DIR = Path(__file__).resolve().parent
# IEEE division and sqrt are kept (no --use_fast_math) so numerics match the torch reference.
BASE_OPTIONS = ("-O3", "-std=c++17", "-lineinfo")
# Extra nvcc flags for experiments (e.g. FLLAMA_NVCC_FLAGS="-DFLLAMA_PDL_TRIGGER=2"); part of the cache key.
EXTRA_OPTIONS = tuple(os.environ.get("FLLAMA_NVCC_FLAGS", "").split())
SIGNATURE_CODES = frozenset("PiIqQf")
STATIC_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

_lock = threading.RLock()
_state: dict[str, Any] = {}  # context, stream, torch stream, modules, functions


# ---------------------------------------------------------------- availability

def find_nvcc() -> str | None:
    """nvcc from PATH, else $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def require_cuda() -> None:
    """Raise DeviceError (one line) naming the first missing piece: GPU, pycuda, nvcc, driver."""
    if not torch.cuda.is_available():
        raise DeviceError(f"no CUDA GPU visible to PyTorch (torch {torch.__version__}, "
                          f"built for CUDA {torch.version.cuda or 'none'})")
    if importlib.util.find_spec("pycuda") is None:
        raise DeviceError("pycuda is not installed (pip install 'fllama[gpu]')")
    if find_nvcc() is None:
        raise DeviceError("nvcc not found on PATH (install the CUDA toolkit)")
    _context()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _context():
    """Push PyTorch's primary context for pycuda (once per process); pop it at exit."""
    with _lock:
        if "ctx" in _state:
            return _state["ctx"]
        try:
            torch.cuda.init()
            import pycuda.driver as drv
            drv.init()
            ctx = drv.Device(torch.cuda.current_device()).retain_primary_context()
            ctx.push()
        except ImportError as e:
            raise DeviceError(f"pycuda cannot be imported: {_one_line(e)}") from None
        except Exception as e:  # pycuda.driver.Error and torch's RuntimeError
            raise DeviceError(f"CUDA driver error: {_one_line(e)}") from None
        # Without the pop, pycuda aborts at interpreter exit ("context stack was not empty").
        atexit.register(ctx.pop)
        _state["ctx"] = ctx
        return ctx


# ---------------------------------------------------------------- streams

def stream():
    """fllama's one pycuda Stream (non-blocking: no implicit sync with the legacy default stream)."""
    with _lock:
        if "stream" not in _state:
            _context()
            import pycuda.driver as drv
            _state["stream"] = drv.Stream(flags=1)
        return _state["stream"]


def torch_stream() -> torch.cuda.ExternalStream:
    """The same stream for PyTorch: run torch ops and capture graphs on it."""
    with _lock:
        if "torch_stream" not in _state:
            s = stream()
            _state["torch_stream"] = torch.cuda.ExternalStream(s.handle)
        return _state["torch_stream"]


# torch's current stream as a raw handle without making a Stream object (the accessor torch's own generated code
# uses; absent from CPU builds, where nothing launches): 0.21 us a call against 7.2 for torch.cuda.current_stream()
# on an H200 host. Every launch checks it, and an eager prefill is a few hundred launches.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The raw CUDA stream torch's ops on device `device_index` go to now."""
    if _raw_current_stream is not None:
        return _raw_current_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class _OnStream:
    """`with on_stream():`'s context manager (a class rather than @contextmanager: no generator per use)."""

    __slots__ = ("_switch",)

    def __enter__(self) -> torch.cuda.ExternalStream:
        ts = torch_stream()
        # Nested use (every launcher wraps itself, and the engine wraps whole passes) finds the stream current
        # already and switches nothing: torch.cuda.stream's enter and exit cost ~21 us of host time on an H200
        # host (device queries, two stream switches), a nested use with this test 4 us (measured in the generator
        # form), paid by each of an eager prefill's few hundred launches, which made short prefills host-bound.
        if torch.cuda.current_device() == ts.device_index and current_stream_handle(ts.device_index) == ts.cuda_stream:
            self._switch = None
            return ts
        self._switch = torch.cuda.stream(ts)
        self._switch.__enter__()
        return ts

    def __exit__(self, *exc) -> None:
        if self._switch is not None:
            self._switch.__exit__(*exc)


def on_stream() -> _OnStream:
    """`with on_stream():` makes fllama's stream torch's current stream (allocations and ops)."""
    return _OnStream()


def synchronize() -> None:
    stream().synchronize()


# ---------------------------------------------------------------- compilation

def device_arch(cc: tuple[int, int] | None = None) -> str:
    """'sm_90a' on Hopper (wgmma and setmaxnreg need the arch-specific target), else 'sm_XY'."""
    major, minor = cc if cc is not None else torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@functools.lru_cache(maxsize=None)
def has_wgmma(device_index: int) -> bool:
    """Whether the GPU runs the wgmma prefill GEMMs (int8_wgmma.cu, awq_wgmma.cu): sm_90 (Hopper) only."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def has_clusters(device_index: int) -> bool:
    """Whether the GPU runs thread-block clusters and distributed shared memory: sm_90 and later."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _gencode(arch: str) -> str:
    return f"-gencode=arch=compute_{arch[3:]},code={arch}"


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise DeviceError("nvcc not found on PATH (install the CUDA toolkit)")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip()


def source_text(cu_file: str) -> str:
    """The .cu text followed by the text of every kernels_cu header it includes (recursively)."""
    seen: list[str] = []

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.append(name)
        path = KERNEL_DIR / name
        if not path.exists():
            if name == cu_file:
                raise FileNotFoundError(f"no kernel source {path}")
            return  # a system header in quotes; nvcc resolves it
        for inc in _INCLUDE.findall(path.read_text()):
            visit(inc)

    visit(cu_file)
    return "".join(f"// ==== {n}\n{(KERNEL_DIR / n).read_text()}" for n in seen if (KERNEL_DIR / n).exists())


def cache_key(cu_file: str, arch: str, options: tuple[str, ...] = (), nvcc: str | None = None) -> str:
    h = hashlib.sha256()
    for part in (source_text(cu_file), arch, "\0".join(BASE_OPTIONS + EXTRA_OPTIONS + tuple(options)),
                 nvcc if nvcc is not None else nvcc_version()):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("FLLAMA_CUDA_CACHE") or Path.home() / ".cache" / "fllama" / "cuda")


def compile_cubin(cu_file: str, arch: str, options: tuple[str, ...] = ()) -> Path:
    """Compile kernels_cu/<cu_file> to a cached cubin for `arch`; returns its path."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise DeviceError("nvcc not found on PATH (install the CUDA toolkit)")
    key = cache_key(cu_file, arch, options)
    out_dir = cache_dir()
    target = out_dir / f"{Path(cu_file).stem}-{arch}-{key[:24]}.cubin"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".cubin", dir=out_dir)
    os.close(fd)
    cmd = [nvcc, "-cubin", _gencode(arch), *BASE_OPTIONS, *EXTRA_OPTIONS, *options, f"-I{KERNEL_DIR}",
           "-o", tmp, str(KERNEL_DIR / cu_file)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            # Kernel sources are ours, so a failure is a bug or a toolkit mismatch: show nvcc's words.
            raise DeviceError(f"nvcc failed on {cu_file} for {arch}: {proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent processes never load a half-written cubin
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _module(cu_file: str, options: tuple[str, ...]):
    """(pycuda Module, cubin path) of a kernel file, compiled and loaded once per process."""
    with _lock:
        modules = _state.setdefault("modules", {})
        if (cu_file, options) not in modules:
            require_cuda()
            import pycuda.driver as drv
            path = compile_cubin(cu_file, device_arch(), options)
            modules[cu_file, options] = (drv.module_from_file(str(path)), str(path))
        return modules[cu_file, options]


def get_function(cu_file: str, name: str, signature: str, options: tuple[str, ...] = ()) -> "KernelFunction":
    """The `extern "C" __global__` entry `name` of kernels_cu/<cu_file>, ready to launch."""
    key = (cu_file, tuple(options), name)
    fn = _state.get("functions", {}).get(key)  # lock-free once made (a dict read is atomic): a lookup per launch
    if fn is None:
        with _lock:
            functions = _state.setdefault("functions", {})
            if key not in functions:
                module, path = _module(cu_file, key[1])
                functions[key] = KernelFunction(module.get_function(name), name, signature, path)
            fn = functions[key]
    if fn.signature != signature:
        raise ValueError(f"{name}: signature {signature!r} differs from the earlier {fn.signature!r}")
    return fn


# ---------------------------------------------------------------- launching

_local = threading.local()


def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, and not turned off with FLLAMA_PDL=0."""
    if os.environ.get("FLLAMA_PDL", "1") == "0":
        return False
    supported = _state.get("pdl")
    if supported is None:
        with _lock:
            supported = _state.setdefault("pdl", torch.cuda.get_device_capability()[0] >= 9)
    return supported


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
            raise DeviceError(f"kernel {self.name} grid={grid} block={block}: {_one_line(e)}") from None

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


# ---------------------------------------------------------------- facts

def device_info() -> dict:
    """What the engine runs on: name, compute capability, SMs, L2, driver and nvcc versions."""
    require_cuda()
    import pycuda.driver as drv
    dev = drv.Device(torch.cuda.current_device())
    attr = drv.device_attribute
    major, minor = dev.compute_capability()
    drv_ver = drv.get_driver_version()
    return {
        "name": dev.name(),
        "cc": f"{major}.{minor}",
        "arch": device_arch((major, minor)),
        "sm_count": dev.get_attribute(attr.MULTIPROCESSOR_COUNT),
        "l2_bytes": dev.get_attribute(attr.L2_CACHE_SIZE),
        "memory_bytes": dev.total_memory(),
        "driver_version": f"{drv_ver // 1000}.{drv_ver % 1000 // 10}",
        "nvcc_version": nvcc_version().splitlines()[-1],
    }
