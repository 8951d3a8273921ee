"""Sampling on the GPU for the generation loop: one GpuSampler per decode bucket (device RNG, seen mask, penalties),
kept so that the sampled decode graph, which holds its buffers, stays valid."""

from __future__ import annotations

import torch

from kernels_cu import build
from kernels_cu.engine.graphs import api
from kernels_cu.sampling import GpuSampler
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
    """The generation loop's sampler interface over a bucket's GpuSampler."""

    def __init__(self, gpu: GpuSampler, tuning: Tuning):
        self.gpu, self.tuning = gpu, tuning
        with build.on_stream():
            self.logits = torch.zeros(gpu.batch, gpu.vocab, dtype=torch.float32, device=gpu.out.device)  # [Bb, V]

    @api
    def observe(self, row: int, tokens: list[int]) -> None:
        with build.on_stream():
            self.gpu.observe(row, tokens)

    @api
    def sample(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        with build.on_stream():
            idx = torch.tensor(rows, device=self.logits.device)
            self.logits[idx] = logits.float()
            out = self.gpu.sample(self.logits)  # [B] int32; rows not asked for are ignored
            return out[idx].long()
