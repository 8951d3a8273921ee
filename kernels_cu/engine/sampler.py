"""Sampling on the GPU for the generation loop: one GpuSampler per decode bucket (device RNG, seen mask, penalties),
kept so that the sampled decode graph, which holds its buffers, stays valid."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.engine.graphs import api
from kernels_cu.sampling import GpuSampler, params_row
from kernels_cu.tuning import Tuning
from model_zoo.sampling import SamplingConfig, fresh_seed


def bucket_sampler(samplers: dict[int, GpuSampler], cfg: SamplingConfig, bucket: int, vocab: int,
                   device: torch.device) -> GpuSampler:
    """The bucket's sampler, made on first use and reconfigured for `cfg`."""
    gpu = samplers.get(bucket)
    with build.on_stream():
        if gpu is None:
            # the loop decides when a row ends, so the kernel's own EOS tracking gets an id that never occurs
            gpu = samplers[bucket] = GpuSampler(bucket, vocab, eos_ids=[-1], device=device)
        gpu.set_config(cfg)
        gpu.reset(cfg.seed if cfg.seed is not None else fresh_seed())
    return gpu


class GpuRowSampler:
    """The generation loop's sampler interface over a bucket's GpuSampler; its rows are the cache's rows."""

    def __init__(self, gpu: GpuSampler, tuning: Tuning):
        self.gpu, self.tuning = gpu, tuning

    @staticmethod
    def check_config(cfg: SamplingConfig) -> None:
        """ConfigError for what the GPU sampler cannot do (top-k above its limit), before a request is queued."""
        params_row(cfg)

    @api
    def configure_row(self, row: int, cfg: SamplingConfig) -> None:
        """A new sequence in `row` with its own sampling parameters and seed (a server's request)."""
        with build.on_stream():
            self.gpu.configure_row(row, cfg)

    @api
    def observe(self, row: int, tokens: list[int]) -> None:
        with build.on_stream():
            self.gpu.observe(row, tokens)

    @api
    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [b, V] of cache rows `rows` -> tokens [b] (int64); the other rows' state is untouched."""
        with build.on_stream():
            idx = torch.tensor(rows, dtype=torch.int32).pin_memory().to(self.gpu.out.device, non_blocking=True)
            return self.gpu.sample(logits.float().contiguous(), rows=idx).long()  # [b]
