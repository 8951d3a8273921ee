"""Run a model one decoder layer at a time over calibration text, observing the quantized linears' inputs.

Only the current layer's weights and one batch of its activations sit on the accelerator, so a model
larger than the GPU can be calibrated (and AWQ-searched); the hidden states of every sample wait in host
memory between layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from calibrate.collectors import ChannelStatsCollector, HistogramCollector
from calibrate.stats import POINT_KINDS, PointStats
from model_zoo.errors import ConfigError
from model_zoo.reference import Observer, layer_forward
from model_zoo.weights import LayerWeights, ModelWeights

# progress(layer_index, tokens_done_in_this_layer)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class CaptureConfig:
    batch: int = 8  # windows per forward
    device: str = "cpu"
    dtype: torch.dtype = torch.float32  # compute dtype on the device

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ConfigError(f"batch must be >= 1, got {self.batch}")


class LayerwiseRunner:
    """Holds the hidden states [n, L, H] of all windows on the host and advances them one layer at a time."""

    def __init__(self, weights: ModelWeights, windows: torch.Tensor, cfg: CaptureConfig):
        self.weights, self.cfg = weights, cfg
        self.config = weights.config
        self.hidden = weights.embed[windows].to("cpu", cfg.dtype)  # [n, L, H]
        n, L = windows.shape
        self.positions = torch.arange(L, device=cfg.device).expand(min(cfg.batch, n), L)  # [b, L]

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[0] * self.hidden.shape[1]

    def batches(self):
        for start in range(0, self.hidden.shape[0], self.cfg.batch):
            yield slice(start, start + self.cfg.batch)

    @torch.inference_mode()
    def run_layer(self, layer: LayerWeights, observer: Observer | None = None,
                  progress: Callable[[int], None] | None = None) -> None:
        """hidden <- layer(hidden); `layer` is moved to the device for this call only."""
        dev = layer.to(self.cfg.device, self.cfg.dtype)
        for sl in self.batches():
            x = self.hidden[sl].to(self.cfg.device)  # [b, L, H]
            y = layer_forward(dev, self.config, x, self.positions[: x.shape[0]], observer=observer)
            self.hidden[sl] = y.to("cpu")
            if progress:
                progress(x.shape[0] * x.shape[1])
        del dev


def capture_stats(weights: ModelWeights, windows: torch.Tensor, bins: int, cfg: CaptureConfig,
                  progress: Progress | None = None) -> dict[str, PointStats]:
    """Histogram and per-channel statistics of each capture point of every layer."""
    runner = LayerwiseRunner(weights, windows, cfg)
    points: dict[str, PointStats] = {}
    for i, layer in enumerate(weights.layers):
        hists = {k: HistogramCollector(bins) for k in POINT_KINDS}
        chans = {k: ChannelStatsCollector() for k in POINT_KINDS}

        def observe(kind: str, x: torch.Tensor) -> None:  # x [tokens, C]
            hists[kind].collect(x)
            chans[kind].collect(x)

        runner.run_layer(layer, observe, None if progress is None else (lambda t, i=i: progress(i, t)))
        for k in POINT_KINDS:
            points[f"layers.{i}.{k}"] = PointStats.from_collectors(hists[k], chans[k])
    return points
