"""fllama's CUDA context and stream: PyTorch's primary context shared with PyCUDA, and one non-blocking stream.

Every launch goes to ONE stream owned by fllama (`stream()`); PyTorch sees it as `torch_stream()`, so engine torch
ops run under `with on_stream():` and `torch.cuda.graph(g, stream=torch_stream())` captures PyCUDA launches and
torch ops in one graph. PyCUDA shares PyTorch's primary context (never pycuda.autoinit, which makes a second one).
Nothing here imports pycuda at module load: CPU-only machines import it freely.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import threading
from typing import Any

import torch

from model_zoo.errors import DeviceError

_lock = threading.RLock()
_state: dict[str, Any] = {}  # context, stream, torch stream


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


def one_line(e: BaseException) -> str:
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
            raise DeviceError(f"pycuda cannot be imported: {one_line(e)}") from None
        except Exception as e:  # pycuda.driver.Error and torch's RuntimeError
            raise DeviceError(f"CUDA driver error: {one_line(e)}") from None
        # Without the pop, pycuda aborts at interpreter exit ("context stack was not empty").
        atexit.register(ctx.pop)
        _state["ctx"] = ctx
        return ctx


def thread_hooks() -> tuple:
    """(enter, exit) for a thread other than the main one that launches fllama's kernels (a server's scheduler):
    PyCUDA keeps a context stack per thread and loads a module only where the stack holds the context, so such a
    thread pushes it (the primary one, which torch uses too) first and pops it last."""
    ctx = _context()
    return ctx.push, type(ctx).pop


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
