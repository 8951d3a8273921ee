"""The engine's DecodePipe (model_zoo/decode_pipe.py): decode steps replayed ahead of the host.

Each launch replays the sampled decode graph (which feeds its sampled ids back as the next step's inputs and
advances the lengths of the rows that decoded), then has a kernel store the ids into a pinned host slot (publish.cu:
a copy-engine transfer of those few bytes would hold the stream longer) and records an event;
the host reads a step only when it needs it. Nothing in a launch waits for the device: joins and leaves travel in
a pinned control slot copied asynchronously, and the host keeps its own copy of each row's length for the
capacity check. A cache of bucket B decodes as the smallest bucket covering rows 0..max(joined row): its leading
rows are views of the same storage, so one request in slot 0 of a 32-row cache runs the batch-1 graph.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels_cu import build
from kernels_cu.engine.cache import GpuCache
from kernels_cu.engine.config import BUCKETS, bucket_of
from kernels_cu.engine.graphs import api
from kernels_cu.engine.sampler import GpuRowSampler
from kernels_cu.publish import publish_ids
from kernels_cu.sampling import GpuSampler
from kernels_cu.tuning import Tuning
from model_zoo.decode_pipe import check_room

# (cache, sampler) -> (graph, its sampled ids [m]): the engine's capture of a sampled decode step
Capture = Callable[[GpuCache, GpuSampler], tuple]

ACTIVE, TOKENS, JOINED = range(3)  # the rows of a control slot, int32 [Bb] each


def leading_rows(cache: GpuCache, m: int) -> GpuCache:
    """Rows 0..m-1 of `cache` as a cache of their own: the same K/V, lengths and step buffers (views), its own
    graphs. Kept in cache.views, since a captured graph holds the addresses."""
    if m == cache.bucket:
        return cache
    view = cache.views.get(m)
    if view is None:
        st = cache.step_buffers()
        view = cache.views[m] = GpuCache(
            k=[t[:m] for t in cache.k], v=[t[:m] for t in cache.v], lengths=cache.lengths[:m],
            max_len=cache.max_len, batch=m, k_scale=[t[:m] for t in cache.k_scale],
            v_scale=[t[:m] for t in cache.v_scale], static={name: t[:m] for name, t in st.items()})
    return view


def leading_sampler(gpu: GpuSampler, m: int, views: dict[int, GpuSampler]) -> GpuSampler:
    """Rows 0..m-1 of a GpuSampler over the same buffers, made once per m."""
    if m == gpu.batch:
        return gpu
    if m not in views:
        views[m] = gpu.leading(m)
    return views[m]


class GpuStep:
    """A launched step: its ids reach the host slot when `event` has passed."""

    def __init__(self, rows: tuple[int, ...], host: torch.Tensor, event: torch.cuda.Event):
        self.rows, self._host, self._event = rows, host, event
        self._tokens: list[int] | None = None

    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._event.synchronize()
            ids = self._host.tolist()
            self._tokens = [ids[r] for r in self.rows]
        return self._tokens


class EnginePipe:
    """Decode steps of one cache with `depth` of them in flight (EngineConfig.pipe_depth)."""

    def __init__(self, capture: Capture, tuning: Tuning, depth: int, cache: GpuCache, sampler: GpuRowSampler):
        if sampler.gpu.batch != cache.bucket:
            raise ValueError(f"a sampler of {sampler.gpu.batch} rows for a cache of {cache.bucket}")
        self.capture, self.tuning, self.depth = capture, tuning, depth
        self.cache, self.gpu = cache, sampler.gpu
        ring, B = depth + 1, cache.bucket
        dev = cache.lengths.device
        self._host = torch.zeros(ring, B, dtype=torch.int32, pin_memory=True)  # sampled ids, one slot per step
        self._ctrl = torch.zeros(ring, 3, B, dtype=torch.int32, pin_memory=True)  # ACTIVE, TOKENS, JOINED
        self._ctrl_np = self._ctrl.numpy()  # the same memory: filled without torch's per-op dispatch
        with build.on_stream():
            self._ctrl_dev = torch.zeros(3, B, dtype=torch.int32, device=dev)
        self._steps: list[GpuStep | None] = [None] * ring
        self._next = 0
        self._inputs: dict[int, int | None] = {}  # row -> input id still to send (None: already on the device)
        self._lengths: dict[int, int] = {}
        self._dirty = True
        self._samplers: dict[int, GpuSampler] = {}

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sorted(self._inputs))

    def join(self, row: int, token: int, length: int) -> None:
        if not 0 <= row < self.cache.bucket:
            raise ValueError(f"row {row} is outside the cache's {self.cache.bucket} rows")
        self._inputs[row], self._lengths[row] = token, length
        self._dirty = True

    def leave(self, row: int) -> None:
        if row in self._inputs:
            del self._inputs[row]
            self._dirty = True

    @api
    def set_length(self, row: int, length: int) -> None:
        with build.on_stream():
            self.cache.lengths[row] = length  # a fill on the stream: after every step launched so far
        self._lengths[row] = length

    @api
    def launch(self) -> GpuStep:
        rows = self.rows
        if not rows:
            raise ValueError("no row has joined the decode pipe")
        check_room(rows, self._lengths, self.cache.capacity)
        slot = self._next
        self._next = (slot + 1) % len(self._steps)
        if self._steps[slot] is not None:  # a step the loop never read: read it before its host slot is reused
            self._steps[slot].tokens()
        m = bucket_of(rows[-1] + 1)
        with build.on_stream():
            if self._dirty:
                self._send_control(slot, rows)
            graph = self._graph(m)
            graph[0].replay()
            publish_ids(self._host[slot, :m], graph[1])  # a kernel's stores, not a copy-engine transfer
            event = torch.cuda.Event()
            event.record(build.torch_stream())
        for r in rows:
            self._lengths[r] += 1
        step = self._steps[slot] = GpuStep(rows, self._host[slot], event)
        return step

    @api
    def warm_up(self) -> None:
        """Capture the decode graph of every bucket of leading rows this cache may decode as, while no step is in
        flight: a capture synchronizes the device and runs the step once eagerly, so one made when a batch first
        grows to a bucket stalls every row decoding beside it."""
        with build.on_stream():
            for m in BUCKETS:
                if m <= self.cache.bucket:
                    self._graph(m)

    def _graph(self, m: int) -> tuple:
        """(graph, its sampled ids) of rows 0..m-1, captured on first use (on fllama's stream)."""
        view = leading_rows(self.cache, m)
        graph = view.graphs.get("sampled")
        if graph is None:
            graph = view.graphs["sampled"] = self.capture(view, leading_sampler(self.gpu, m, self._samplers))
        return graph

    def _send_control(self, slot: int, rows: tuple[int, ...]) -> None:
        """The joined rows and the first inputs of new ones, to the step buffers (on fllama's stream)."""
        ctrl = self._ctrl_np[slot]
        ctrl.fill(0)
        ctrl[ACTIVE, list(rows)] = 1
        for r, tok in self._inputs.items():
            if tok is not None:
                ctrl[TOKENS, r], ctrl[JOINED, r] = tok, 1
                self._inputs[r] = None
        st = self.cache.step_buffers()
        self._ctrl_dev.copy_(self._ctrl[slot], non_blocking=True)
        st["active"].copy_(self._ctrl_dev[ACTIVE])
        torch.where(self._ctrl_dev[JOINED].bool(), self._ctrl_dev[TOKENS], st["tokens"], out=st["tokens"])
        self._dirty = False
