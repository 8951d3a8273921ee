"""publish.cu: a decode step's sampled ids written by the GPU straight into a pinned host buffer (engine/pipe.py)."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.checks import check_tensor

MAX_IDS = 1024  # one block, a thread an id


def publish_ids(host: torch.Tensor, ids: torch.Tensor) -> None:
    """host[:m] = ids (int32 [m] on the GPU), host a pinned int32 CPU tensor; on fllama's stream, so the host may
    read host[:m] once an event recorded after this call has passed."""
    m = ids.numel()
    check_tensor(ids, "ids", torch.int32, (m,), align=4)
    if host.device.type != "cpu" or not host.is_pinned() or host.dtype != torch.int32 or not host.is_contiguous():
        raise ValueError("host must be a contiguous pinned int32 CPU tensor")
    if not 0 < m <= min(host.numel(), MAX_IDS):
        raise ValueError(f"{m} ids for a host buffer of {host.numel()} (at most {MAX_IDS})")
    with build.on_stream():
        fn = build.get_function("publish.cu", "publish_ids", "PPi")
        fn((1,), (32 * ((m + 31) // 32),), host.data_ptr(), ids, m)


def publish_ids_ref(host: torch.Tensor, ids: torch.Tensor) -> None:
    """The same through torch: a device-to-host copy."""
    host[:ids.numel()].copy_(ids)
