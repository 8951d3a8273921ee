"""Calibration methods and their parameters (the CalibConfig that travels from the CLI to the ranges)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from model_zoo.errors import ConfigError


class CalibMethod(str, Enum):
    """How an activation range (amax) is chosen from the collected statistics."""

    MAX = "max"  # running max |x|: no clipping, outliers stretch the range
    PERCENTILE = "percentile"  # clip the top (100 - p)% of |x|
    MSE = "mse"  # minimise the fake-quantization MSE over the histogram
    ENTROPY = "entropy"  # minimise KL(P || Q) between the histogram and its 128-level version (TensorRT)
    # fp8 static only, at quantize time: per capture point, the candidate range (the four above and a grid) whose
    # rounding moves that point's linears' outputs least, their weights quantized (calibrate/fp8_act_range.py)
    OUTPUT = "output"

    @classmethod
    def parse(cls, name: str | "CalibMethod") -> "CalibMethod":
        if isinstance(name, cls):
            return name
        try:
            return cls(str(name).lower())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown calibration method {name!r}; methods: {choices}, all") from None


# the methods that read a histogram alone: what `fllama calibrate` reports and `--method all` means
ALL_METHODS: tuple[CalibMethod, ...] = (CalibMethod.MAX, CalibMethod.PERCENTILE, CalibMethod.MSE, CalibMethod.ENTROPY)


class QuantGrid(str, Enum):
    """The number grid a range is judged on: MSE and entropy depend on it, max and percentile do not."""

    INT8 = "int8"  # 255 uniform levels, scale amax / 127
    FP8 = "fp8"  # float8 e4m3: relative steps, subnormals near zero, saturation at 448; scale amax / 448


@dataclass(frozen=True)
class CalibConfig:
    """Which method(s) to apply and their parameters; defaults are pytorch-quantization's."""

    method: CalibMethod | None = None  # None = all four
    percentile: float = 99.99
    bins: int = 2048
    start_bin: int = 128  # MSE / entropy never clip below bin 128 (a 16x range cut with 2048 bins)
    stride: int = 1
    num_levels: int = 128  # positive int8 levels the entropy search merges into (2^(8-1))

    def __post_init__(self) -> None:
        if self.method is not None:
            object.__setattr__(self, "method", CalibMethod.parse(self.method))
        if self.method is CalibMethod.OUTPUT:
            raise ConfigError("the output calibrator needs the quantized weights: it is chosen by `fllama quantize "
                              "--act static --calibrator output`, from the stats any --method collects")
        if not (0.0 < float(self.percentile) <= 100.0):
            raise ConfigError(f"invalid percentile {self.percentile}: it must be in (0, 100]")
        if int(self.bins) != self.bins or self.bins < 128:
            raise ConfigError(f"invalid bins {self.bins}: at least 128 histogram bins are needed")
        if self.start_bin < 1 or self.start_bin > self.bins:
            raise ConfigError(f"invalid start_bin {self.start_bin}: it must be in [1, bins={self.bins}]")
        if self.stride < 1:
            raise ConfigError(f"invalid stride {self.stride}: it must be >= 1")
        if self.num_levels < 2 or self.num_levels & (self.num_levels - 1):
            raise ConfigError(f"invalid num_levels {self.num_levels}: it must be a power of two >= 2")

    @property
    def methods(self) -> tuple[CalibMethod, ...]:
        return ALL_METHODS if self.method is None else (self.method,)

    @property
    def num_bits(self) -> int:
        """Signed bit width whose positive half has num_levels levels (128 -> 8)."""
        return self.num_levels.bit_length()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["method"] = "all" if self.method is None else self.method.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CalibConfig":
        d = dict(d)
        method = d.pop("method", None)
        return cls(method=None if method in (None, "all") else method, **d)


def parse_methods(name: str) -> CalibMethod | None:
    """CLI spelling -> method; 'all' -> None."""
    return None if str(name).lower() == "all" else CalibMethod.parse(name)
