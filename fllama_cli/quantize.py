"""`fllama quantize`: quantized checkpoints."""

from __future__ import annotations

from model_zoo.errors import FllamaError


def quantize_cmd() -> None:
    """Export a per-channel INT8 (W8A8) or AWQ int4 checkpoint."""
    raise FllamaError("fllama quantize is not built yet")
