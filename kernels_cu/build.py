"""The PyCUDA build layer: the only code that compiles .cu files (nvcc, cached cubins) and loads them.

- `get_function("rmsnorm.cu", "rmsnorm_plain_nv4", "PPPPPPPif")` compiles kernels_cu/rmsnorm.cu once per process for
  the current device (sm_90a on Hopper), with the cubin cached on disk by a hash of the sources, options and nvcc,
  and returns a `KernelFunction` (kernel_function.py: signature, launch, programmatic dependent launch).
- The context and the one stream every launch goes to are cuda_context.py's; this module re-exports them, so
  launchers need only `build`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kernels_cu.cuda_context import (current_stream_handle, find_nvcc, on_stream, require_cuda,  # noqa: F401
                                     stream, synchronize, torch_stream)
from kernels_cu.kernel_function import (KernelFunction, pdl_supported, programmatic,  # noqa: F401
                                        programmatic_active)
from model_zoo.errors import DeviceError

KERNEL_DIR = Path(__file__).resolve().parent
# IEEE division and sqrt are kept (no --use_fast_math) so numerics match the torch reference.
BASE_OPTIONS = ("-O3", "-std=c++17", "-lineinfo")
# Extra nvcc flags for experiments (e.g. FLLAMA_NVCC_FLAGS="-DFLLAMA_PDL_TRIGGER=2"); part of the cache key.
EXTRA_OPTIONS = tuple(os.environ.get("FLLAMA_NVCC_FLAGS", "").split())
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

_lock = threading.RLock()
_modules: dict[tuple, tuple[Any, str]] = {}  # (cu_file, options) -> (pycuda Module, cubin path)
_functions: dict[tuple, KernelFunction] = {}  # (cu_file, options, name) -> KernelFunction


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


def cubin_path(cu_file: str, arch: str, options: tuple[str, ...] = ()) -> Path:
    """Where kernels_cu/<cu_file> built for `arch` with `options` is cached."""
    return cache_dir() / f"{Path(cu_file).stem}-{arch}-{cache_key(cu_file, arch, options)[:24]}.cubin"


def compile_cubin(cu_file: str, arch: str, options: tuple[str, ...] = ()) -> Path:
    """Compile kernels_cu/<cu_file> to a cached cubin for `arch`; returns its path."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise DeviceError("nvcc not found on PATH (install the CUDA toolkit)")
    target = cubin_path(cu_file, arch, options)
    if target.exists():
        return target
    out_dir = target.parent
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


def unbuilt(arch: str) -> list[str]:
    """The kernel files (kernels_cu/*.cu) with no cubin cached for `arch`, what a first run on a machine builds; on
    Hopper only (sm_90a): elsewhere the Hopper-only files would not build, and each file builds when first used."""
    if arch != "sm_90a":
        return []
    return [p.name for p in sorted(KERNEL_DIR.glob("*.cu")) if not cubin_path(p.name, arch).exists()]


def prebuild(arch: str, files: Sequence[str], workers: int | None = None,
             done: Callable[[str], None] | None = None) -> None:
    """Build `files` for `arch` at once, `workers` nvcc processes side by side (default: the cores, at most 8; one
    takes ~0.5 GB): a first run on a machine otherwise builds each file when a kernel of it is first launched, one
    after another (minutes in all, up to ~45 s a file). done(file) as each is cached."""
    pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1))  # threads: each waits on its nvcc
    try:
        jobs = {pool.submit(compile_cubin, f, arch): f for f in files}
        for job in as_completed(jobs):
            job.result()
            if done is not None:
                done(jobs[job])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure or Ctrl-C, no file still queued starts


def _module(cu_file: str, options: tuple[str, ...]):
    """(pycuda Module, cubin path) of a kernel file, compiled and loaded once per process."""
    with _lock:
        if (cu_file, options) not in _modules:
            require_cuda()
            import pycuda.driver as drv
            path = compile_cubin(cu_file, device_arch(), options)
            _modules[cu_file, options] = (drv.module_from_file(str(path)), str(path))
        return _modules[cu_file, options]


def get_function(cu_file: str, name: str, signature: str, options: tuple[str, ...] = ()) -> KernelFunction:
    """The `extern "C" __global__` entry `name` of kernels_cu/<cu_file>, ready to launch."""
    key = (cu_file, tuple(options), name)
    fn = _functions.get(key)  # lock-free once made (a dict read is atomic): a lookup per launch
    if fn is None:
        with _lock:
            if key not in _functions:
                module, path = _module(cu_file, key[1])
                _functions[key] = KernelFunction(module.get_function(name), name, signature, path)
            fn = _functions[key]
    if fn.signature != signature:
        raise ValueError(f"{name}: signature {signature!r} differs from the earlier {fn.signature!r}")
    return fn


def loaded_functions() -> list[KernelFunction]:
    """Every kernel loaded so far (tests count their launches)."""
    return list(_functions.values())


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
