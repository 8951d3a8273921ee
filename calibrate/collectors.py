"""Collectors: accumulate activation statistics batch by batch, on the tensor's own device.

They only collect; calibrate.ranges turns what they hold into an amax. A capture point keeps one
HistogramCollector (per-tensor |x| histogram) and one ChannelStatsCollector (per input channel
max |x| and mean |x|, which SmoothQuant and AWQ need), and calls .collect(x) with x [tokens, channels].
Each collect costs one host sync (the batch max, needed to decide whether the histogram grows).
"""

from __future__ import annotations

import math

import torch

from model_zoo.errors import ConfigError

# torch.histc counts in the input's dtype; float32 counts are exact only up to 2^24 per bin.
_HISTC_CHUNK = 1 << 24
_SUM_ROWS = 4096  # rows summed in float32 before the float64 running sum (relative error ~1e-7)


class MaxCollector:
    """Running max |x|; axis=None: one value per tensor; axis=k: one per index of dim k (-1: per channel)."""

    def __init__(self, axis: int | None = None):
        self.axis = axis
        self._amax: torch.Tensor | None = None

    def collect(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            if self.axis is None:
                batch = x.abs().amax().float()  # []
            else:
                axis = self.axis % x.dim()
                dims = [d for d in range(x.dim()) if d != axis]
                batch = x.abs().amax(dim=dims).float() if dims else x.abs().float()  # [C]
            if self._amax is not None and self._amax.shape != batch.shape:
                raise ConfigError(f"MaxCollector got shape {tuple(batch.shape)} after {tuple(self._amax.shape)}")
            self._amax = batch if self._amax is None else torch.maximum(self._amax, batch)

    def reset(self) -> None:
        self._amax = None

    @property
    def amax(self) -> torch.Tensor | None:
        return self._amax


class HistogramCollector:
    """Histogram of |x| over [0, running max] with `bins` bins at first (pytorch-quantization's design).

    When a later batch has a larger max, bins of the same width are appended so earlier counts stay
    valid. Counts accumulate in float64 on x's device. If the bin count would pass max_bins (an outlier
    far above the first batch's max), adjacent bins are merged pairwise (width doubles) to bound the
    memory and the O(bins^2) MSE search.
    """

    def __init__(self, bins: int = 2048, max_bins: int | None = None):
        if bins < 128:
            raise ConfigError(f"invalid bins {bins}: at least 128 histogram bins are needed")
        self.bins = bins
        self.max_bins = max_bins if max_bins is not None else 8 * bins
        if self.max_bins < bins:
            raise ConfigError(f"max_bins {self.max_bins} is below bins {bins}")
        self.reset()

    def reset(self) -> None:
        self._hist: torch.Tensor | None = None  # [n] float64 counts
        self._width = 0.0
        self._pending_zeros = 0.0  # all-zero batches seen before any non-zero max fixed the width
        self.count = 0  # elements collected

    def collect(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            a = x.detach().reshape(-1).abs()  # [numel]
            if a.numel() == 0:
                return
            x_max = float(a.max())  # the one host sync per batch
            if not math.isfinite(x_max):
                raise ConfigError("HistogramCollector got a non-finite activation (inf or nan)")
            self.count += a.numel()
            if self._hist is None:
                if x_max == 0.0:
                    self._pending_zeros += a.numel()
                    return
                self._width = x_max / self.bins
                self._hist = torch.zeros(self.bins, dtype=torch.float64, device=a.device)  # [bins]
                self._hist[0] += self._pending_zeros
                self._pending_zeros = 0.0
            else:
                self._grow_to(x_max)
            self._hist += self._histc(a, x_max)

    @property
    def hist(self) -> torch.Tensor | None:
        """Counts [n] (float64), or None before any data; all-zero data gives `bins` bins of width 0."""
        if self._hist is None and self._pending_zeros:
            h = torch.zeros(self.bins, dtype=torch.float64)  # [bins]
            h[0] = self._pending_zeros
            return h
        return self._hist

    @property
    def edges(self) -> torch.Tensor | None:
        """Bin edges [n + 1] (float64, on the CPU): edges[i] = i * width."""
        h = self.hist
        if h is None:
            return None
        return torch.arange(h.numel() + 1, dtype=torch.float64) * self._width  # [n + 1]

    def _histc(self, a: torch.Tensor, x_max: float) -> torch.Tensor:
        n = self._hist.numel()
        top = max(n * self._width, x_max)  # n * width may round one ulp below the max element
        out = torch.zeros(n, dtype=torch.float64, device=a.device)  # [n]
        for chunk in a.split(_HISTC_CHUNK):
            out += torch.histc(chunk.float(), bins=n, min=0.0, max=top).double()  # chunk [<= 2^24]
        return out

    def _grow_to(self, x_max: float) -> None:
        n = self._hist.numel()
        if x_max <= n * self._width:
            return
        needed = math.ceil(x_max / self._width)
        while needed > self.max_bins:
            self._merge_pairs()
            needed = math.ceil(x_max / self._width)
        needed = max(needed, self._hist.numel())
        grown = torch.zeros(needed, dtype=torch.float64, device=self._hist.device)  # [needed]
        grown[: self._hist.numel()] = self._hist
        self._hist = grown

    def _merge_pairs(self) -> None:
        h = self._hist
        if h.numel() % 2:
            h = torch.cat([h, h.new_zeros(1)])  # [n + 1]
        self._hist = h.view(-1, 2).sum(dim=1)  # [n / 2]
        self._width *= 2.0


class ChannelStatsCollector:
    """Per input channel (last dim) max |x| and mean |x| over every token collected."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._max: torch.Tensor | None = None  # [C] float32
        self._sum: torch.Tensor | None = None  # [C] float64
        self.count = 0  # tokens (rows) collected

    def collect(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            rows = x.detach().reshape(-1, x.shape[-1])  # [T, C]
            if rows.shape[0] == 0:
                return
            a = rows.abs()  # [T, C]
            batch_max = a.amax(dim=0).float()  # [C]
            # float64 reductions are ~20x slower on CPU: sum blocks of rows in float32, blocks in float64
            batch_sum = sum(blk.sum(dim=0, dtype=torch.float32).double() for blk in a.split(_SUM_ROWS))  # [C]
            if self._max is None:
                self._max, self._sum = batch_max, batch_sum
            else:
                if self._max.shape != batch_max.shape:
                    raise ConfigError(
                        f"ChannelStatsCollector got {batch_max.numel()} channels after {self._max.numel()}")
                self._max = torch.maximum(self._max, batch_max)
                self._sum = self._sum + batch_sum
            self.count += rows.shape[0]

    @property
    def max_abs(self) -> torch.Tensor | None:
        return self._max

    @property
    def mean_abs(self) -> torch.Tensor | None:
        return None if self._sum is None else (self._sum / self.count).float()  # [C]
