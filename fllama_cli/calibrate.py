"""`fllama calibrate`: activation statistics and ranges."""

from __future__ import annotations

from model_zoo.errors import FllamaError


def calibrate_cmd() -> None:
    """Collect activation statistics and compute ranges by max, percentile, MSE and entropy."""
    raise FllamaError("fllama calibrate is not built yet")
