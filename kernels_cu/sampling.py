"""Sampling on the GPU (sampling.cu): greedy, temperature, top-k, top-p, repetition penalty, per-row finished
flags and a device-side Philox random state, so a whole decode step (sampling included) replays as one graph.

Device state (GpuSampler owns it; `sample` is the bare launcher):
    params   fp32 [B, 4]   temperature, top_k, top_p, repetition_penalty per row (values change, buffer stays)
    seen     uint8 [B, V]  tokens in each row so far (prompt via observe(); the kernel marks what it samples)
    finished int32 [B]     finished rows output eos_ids[0]; sampling any eos id finishes a row
    rng      int64 [B, 2]  per row: its Philox key (the seed) and draw counter (the kernel increments it), so a
                           row's draws depend on its own seed alone, not on its slot or the batch around it
Semantics follow model_zoo.sampling.TorchSampler (penalty, then greedy or temperature -> top-k -> top-p ->
softmax draw). Limits: top_k <= MAX_TOP_K, V <= MAX_VOCAB; with top_p alone the nucleus is searched among the
MAX_TOP_K largest logits (exact whenever the nucleus holds fewer tokens); ties at the k-th value are kept as in
torch, up to 2048 candidates (past that, the ties of lowest index).

On GPUs with thread-block clusters (sm_90) a row may run over P blocks, one cluster a row (`cluster_blocks`:
tuning's sample_cluster_blocks, where the vocabulary is large enough and the clusters of the batch are resident at
once): the max/argmax pass, for temperature-only rows the segments' sums, and for top-k / top-p rows the radix
select and the candidate gather too; the tokens and the state are those of the one-block launch, bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kernels_cu import build, tuning
from kernels_cu.checks import check_tensor
from model_zoo.errors import ConfigError
from model_zoo.sampling import SamplingConfig, apply_repetition_penalty, filter_top_k_top_p, fresh_seed, row_seed

# out, seen, finished, rng, logits, params, eos_ids, n_eos, V, next_ids, lengths, active, rows
SIGNATURE = "PPPPPPPiiPPPP"
SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
THREADS = 1024
MAX_TOP_K = 1024
CLUSTER_MAX = 16  # blocks per cluster of the `_cl` entries (sampling.cu; non-portable above 8)
CLUSTER_MAX_VOCAB = 64 * 8192  # a cluster's row: block 0 holds its segment sums (SEG_CAP * SEG_TOKENS)
MAX_VOCAB = 256 * 8192  # any row: block 0 holds every segment's sum (SEG_MAX * SEG_TOKENS)


def params_row(cfg: SamplingConfig) -> list[float]:
    if cfg.top_k > MAX_TOP_K:
        raise ConfigError(f"top-k on the GPU is limited to {MAX_TOP_K}, got {cfg.top_k}")
    return [cfg.temperature, float(cfg.top_k), cfg.top_p, cfg.repetition_penalty]


def params_tensor(cfgs: SamplingConfig | Sequence[SamplingConfig], batch: int) -> torch.Tensor:
    """fp32 [B, 4] on the CPU: one config for every row, or one per row."""
    rows = [cfgs] * batch if isinstance(cfgs, SamplingConfig) else list(cfgs)
    if len(rows) != batch:
        raise ValueError(f"{len(rows)} sampling configs for a batch of {batch}")
    return torch.tensor([params_row(c) for c in rows], dtype=torch.float32)  # [B, 4]


@dataclass(frozen=True)
class StepState:
    """A captured decode step's state that the sampler advances, int32 [B] each: next_ids = the sampled tokens
    (the next step's input), lengths += active (the rows that decoded this step)."""
    next_ids: torch.Tensor
    lengths: torch.Tensor
    active: torch.Tensor


def sample(logits: torch.Tensor, params: torch.Tensor, seen: torch.Tensor, finished: torch.Tensor,
           rng: torch.Tensor, eos_ids: torch.Tensor, out: torch.Tensor | None = None,
           step: StepState | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits fp16/fp32 [n, V] -> tokens int32 [n]; updates seen, finished and the rng counters in place, and
    `step` when given. Without `rows` logits row i is state row i (n = B); with rows (int32 [n], distinct) it is
    state row rows[i], and no other row's state changes."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got {tuple(logits.shape)}")
    n, V = logits.shape
    if V > MAX_VOCAB:
        raise ValueError(f"the GPU sampler takes vocabularies of up to {MAX_VOCAB:,} tokens, got {V:,}")
    B = params.shape[0] if rows is not None else n
    check_tensor(logits, "logits", (torch.float16, torch.float32), align=logits.element_size())
    check_tensor(params, "params", torch.float32, (B, 4), align=4)
    check_tensor(seen, "seen", torch.uint8, (B, V), align=1)
    check_tensor(finished, "finished", torch.int32, (B,), align=4)
    check_tensor(rng, "rng", torch.int64, align=8)
    if rng.dim() != 2 or rng.shape[1] != 2 or rng.shape[0] < B:  # rows past B (a leading view's parent) unread
        raise ValueError(f"rng must be int64 [>= {B}, 2] (a key and a counter per row), got {tuple(rng.shape)}")
    if eos_ids.dim() != 1 or eos_ids.numel() < 1:
        raise ValueError("eos_ids must be a 1-D tensor holding at least one id")
    check_tensor(eos_ids, "eos_ids", torch.int32, align=4)
    if rows is not None:
        check_tensor(rows, "rows", torch.int32, (n,), align=4)
        if step is not None:
            raise ValueError("a decode step's bookkeeping (step) samples every row: no rows")
    if out is None:
        out = torch.empty(n, dtype=torch.int32, device=logits.device)
    check_tensor(out, "out", torch.int32, (n,), align=4)
    step_args = (None, None, None)
    if step is not None:
        for name in ("next_ids", "lengths", "active"):
            check_tensor(getattr(step, name), name, torch.int32, (B,), align=4)
        step_args = (step.next_ids, step.lengths, step.active)
    if n:
        _launch(logits, (out, seen, finished, rng, logits, params, eos_ids, eos_ids.numel(), V, *step_args, rows))
    return out


def cluster_blocks(n: int, V: int, blocks: int, min_vocab: int, max_clusters: Callable[[int], int] | None) -> int:
    """Blocks per logits row: 1 (one block a row), or the largest P <= `blocks` (and <= the row's 8-token chunks)
    whose n clusters the GPU holds at once (max_clusters(P); None: no clusters): a cluster that does not fit
    waits for a whole one to finish, so a partial second wave costs more than a smaller P. Rows of more than
    CLUSTER_MAX_VOCAB tokens take one block."""
    if max_clusters is None or n == 0 or blocks < 2 or V < min_vocab or V > CLUSTER_MAX_VOCAB:
        return 1
    for p in range(min(blocks, CLUSTER_MAX, -(-V // 8)), 1, -1):
        if max_clusters(p) >= n:
            return p
    return 1


def launch_blocks(n: int, V: int, dtype: torch.dtype, device_index: int) -> int:
    """Blocks per row a launch of n rows of V logits takes on this GPU under the Tuning in force (1: one block a
    row, the plain entry; more: the `_cl` entry)."""
    t, max_clusters = tuning.current(), None
    if t.sample_cluster_blocks > 1 and V >= t.sample_cluster_min_vocab and build.has_clusters(device_index):
        fn_cl = build.get_function("sampling.cu", _entry(dtype) + "_cl", SIGNATURE)
        max_clusters = lambda p: fn_cl.max_active_clusters((p, n), (THREADS,), 0, (p, 1, 1))  # noqa: E731
    return cluster_blocks(n, V, t.sample_cluster_blocks, t.sample_cluster_min_vocab, max_clusters)


def _entry(dtype: torch.dtype) -> str:
    return "sample_f16" if dtype == torch.float16 else "sample_f32"


def _launch(logits: torch.Tensor, args: tuple) -> None:
    """One block a row (grid (n)), or a cluster of P blocks a row (grid (P, n))."""
    n, V = logits.shape
    P = launch_blocks(n, V, logits.dtype, logits.device.index or 0)
    if P > 1:
        fn = build.get_function("sampling.cu", _entry(logits.dtype) + "_cl", SIGNATURE)
        fn((P, n), (THREADS,), *args, cluster=(P, 1, 1))
    else:
        build.get_function("sampling.cu", _entry(logits.dtype), SIGNATURE)((n,), (THREADS,), *args)


def sampling_probs_ref(logits: torch.Tensor, params: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The distribution each row is drawn from, fp64 [B, V] (one-hot for greedy rows), by model_zoo's rules."""
    probs = []
    for b in range(logits.shape[0]):
        t, k, p, pen = (float(v) for v in params[b].tolist())
        cfg = SamplingConfig(temperature=t, top_k=int(round(k)), top_p=p, repetition_penalty=pen)
        row = apply_repetition_penalty(logits[b:b + 1].float(), seen[b:b + 1].bool(), pen)  # [1, V]
        if cfg.greedy:
            probs.append(torch.nn.functional.one_hot(row.argmax(-1), row.shape[-1]).double())
        else:
            temp = torch.full_like(row, t)  # tensor divisor: IEEE division, as the kernel
            probs.append(filter_top_k_top_p(row / temp, cfg.top_k, p).double().softmax(-1))
    return torch.cat(probs)  # [B, V]


class GpuSampler:
    """The device buffers of `sample` for a batch, with host-side setters that validate values."""

    def __init__(self, batch: int, vocab: int, eos_ids: Sequence[int], device: torch.device | str = "cuda",
                 seed: int = 0, config: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig()):
        if not eos_ids:
            raise ConfigError("GPU sampling needs at least one end-of-sequence id")
        if vocab > MAX_VOCAB:
            raise ConfigError(f"GPU sampling takes vocabularies of up to {MAX_VOCAB:,} tokens, got {vocab:,}")
        self.batch, self.vocab = batch, vocab
        self.params = params_tensor(config, batch).to(device)  # [B, 4]
        self.seen = torch.zeros(batch, vocab, dtype=torch.uint8, device=device)  # [B, V]
        self.finished = torch.zeros(batch, dtype=torch.int32, device=device)  # [B]
        self.rng = torch.zeros(batch, 2, dtype=torch.int64, device=device)  # [B, 2] key, draw counter
        self.eos_ids = torch.tensor(list(eos_ids), dtype=torch.int32, device=device)  # [n_eos]
        self.out = torch.zeros(batch, dtype=torch.int32, device=device)  # [B]
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """New sequences: clear seen/finished, seed row b with row_seed(seed, b), restart the draw counters."""
        self.seen.zero_()
        self.finished.zero_()
        keys = [[row_seed(seed & SEED_MASK, b), 0] for b in range(self.batch)]
        self.rng.copy_(torch.tensor(keys, dtype=torch.int64).reshape(self.batch, 2))

    def set_config(self, config: SamplingConfig | Sequence[SamplingConfig]) -> None:
        self.params.copy_(params_tensor(config, self.batch))  # copy_, not rebind: graphs keep the pointer

    def configure_row(self, row: int, config: SamplingConfig) -> None:
        """A new sequence in `row`: its params, its seed (cfg.seed, else a fresh one), nothing seen, not finished.
        Copies from pinned memory, in stream order: no wait for the steps in flight (the kernel reads params,
        rng and finished before its programmatic wait, so they are written by copies, never by a kernel)."""
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is outside the sampler's {self.batch} rows")
        seed = (config.seed if config.seed is not None else fresh_seed()) & SEED_MASK
        self.params[row].copy_(_pinned(params_row(config), torch.float32), non_blocking=True)
        self.rng[row].copy_(_pinned([seed, 0], torch.int64), non_blocking=True)
        self.finished[row:row + 1].copy_(_pinned([0], torch.int32), non_blocking=True)
        self.seen[row].zero_()

    def observe(self, row: int, tokens: Sequence[int]) -> None:
        """Mark prompt tokens as seen (the penalty covers the prompt, as in transformers)."""
        if tokens:
            ids = _pinned(list(tokens), torch.int64).to(self.seen.device, non_blocking=True)
            self.seen[row].index_fill_(0, ids, 1)

    def leading(self, m: int) -> "GpuSampler":
        """Rows 0..m-1 as a sampler of their own over the same buffers (a decode graph of the first m rows)."""
        if not 0 < m <= self.batch:
            raise ValueError(f"{m} leading rows of a sampler of {self.batch}")
        view = copy.copy(self)
        view.batch = m
        for name in ("params", "seen", "finished", "rng", "out"):
            setattr(view, name, getattr(self, name)[:m])
        return view

    def sample(self, logits: torch.Tensor, step: StepState | None = None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] -> self.out int32 [B] (the same tensor each call, so a graph can read it); with rows
        (int32 [n]), logits [n, V] of those rows -> a new int32 [n]."""
        if rows is not None:
            return sample(logits, self.params, self.seen, self.finished, self.rng, self.eos_ids, rows=rows)
        return sample(logits, self.params, self.seen, self.finished, self.rng, self.eos_ids, self.out, step)


def _pinned(values: Sequence[float] | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor in pinned memory: a non_blocking copy from it neither waits for the stream nor reads it late
    (torch's pinned allocator keeps the block until the copy has run)."""
    return torch.tensor(list(values), dtype=dtype).pin_memory()
