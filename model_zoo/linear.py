"""Linear layers of the reference model: dense here; quantized kinds implement the same protocol."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class Linear(Protocol):
    """y = x @ W^T for x [..., in_features] -> [..., out_features], whatever W's storage."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dense_weight(self) -> torch.Tensor:
        """W as a floating tensor [out_features, in_features] (dequantized where quantized)."""
        ...

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Linear": ...

    def nbytes(self) -> int:
        """Bytes the stored weight (and its scales) take."""
        ...


class DenseLinear:
    """A floating-point weight [N, K]; the compute dtype follows the weight."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [N, K]
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def to(self, device=None, dtype=None) -> "DenseLinear":
        return DenseLinear(self.weight.to(device=device, dtype=dtype))

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
