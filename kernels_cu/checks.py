"""Argument checks and launch shapes shared by the kernel launchers (no pycuda, no GPU needed)."""

from __future__ import annotations

import torch

from model_zoo.errors import ConfigError

MAX_THREADS = 1024
ROW_THREADS = 256  # row kernels keep <= 256 threads while a row fits in 4 vectors per thread
ROW_THREADS_NV8 = 512  # the 8-vector instantiations are compiled with __launch_bounds__(512) (row_quant.cuh)


def check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype | tuple[torch.dtype, ...],
                 shape: tuple[int, ...] | None = None, align: int = 16) -> None:
    """A contiguous CUDA tensor of `dtype` (and `shape`) whose data pointer is `align`-byte aligned."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % align:
        # slices such as x[1:] keep the parent's storage and can break vector loads
        raise ValueError(f"{name} must be {align}-byte aligned for vector loads (data_ptr % {align} = "
                         f"{t.data_ptr() % align})")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on the GPU, got {t.device}")


def check_multiple(value: int, of: int, what: str) -> None:
    if value % of:
        raise ConfigError(f"{what} must be a multiple of {of} for the CUDA kernels, got {value}")


def row_launch(n_vec: int) -> tuple[int, int]:
    """(vectors per thread NV, threads) for a row kernel over n_vec 16-byte vectors."""
    for nv in (1, 2, 4):
        if n_vec <= ROW_THREADS * nv:
            return nv, _round_warp(-(-n_vec // nv))
    if n_vec <= ROW_THREADS_NV8 * 8:
        return 8, _round_warp(-(-n_vec // 8))
    raise ConfigError(f"rows of {n_vec * 8} fp16 values exceed the row kernels' limit of {ROW_THREADS_NV8 * 64}")


def silu_row_launch(n_vec: int) -> tuple[int, int]:
    """(NV, threads) for a SwiGLU row kernel (silu_mul.cuh): row_launch's up to 4 vectors a thread, then 4 vectors
    on up to MAX_THREADS threads (its loads all in flight at once: 8 vectors a thread spill or hold too many
    registers for enough resident threads)."""
    if n_vec <= ROW_THREADS * 4:
        return row_launch(n_vec)
    if n_vec <= MAX_THREADS * 4:
        return 4, _round_warp(-(-n_vec // 4))
    raise ConfigError(f"rows of {n_vec * 8} fp16 values exceed the SwiGLU kernels' limit of {MAX_THREADS * 32}")


def _round_warp(n: int) -> int:
    return max(32, -(-n // 32) * 32)


def out_or_new(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor,
               name: str, align: int = 16) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(out, name, dtype, shape, align)
    return out


def check_static_amax(static_amax: torch.Tensor | None, name: str = "static_amax") -> None:
    """A static activation range (int8's amax, fp8's scale): None (dynamic per token) or one fp32 value on the
    device (a pointer, so a captured graph keeps reading it)."""
    if static_amax is None:
        return
    check_tensor(static_amax, name, torch.float32, align=4)
    if static_amax.numel() != 1:
        raise ValueError(f"{name} must hold one value, got {static_amax.numel()}")
