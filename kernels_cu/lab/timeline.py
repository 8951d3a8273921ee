"""Where a decode step's time goes when its kernels overlap: the critical-path increment of each kernel.

Under programmatic launch a kernel starts before the previous one ends (it prefetches, then waits), so per-kernel
durations overlap and add up to more than the step; a profile of durations (profile_engine's table) misreads
them. In a chain where each kernel waits for the one before, the step is the sum of each kernel's end minus the
previous kernel's end: that increment is what the kernel costs the step. `critical_path` turns a list of kernel
intervals (CUPTI's, from torch.profiler's trace) into those increments per kernel name.

    python -m kernels_cu.lab.profile_engine --scheme int8 --tokens 512 --timeline
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    start: float  # us
    dur: float  # us

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclass(frozen=True)
class KernelCost:
    name: str
    per_step: float  # launches per step
    increment: float  # mean us: its end minus the previous kernel's end
    duration: float  # mean us: its own start to end
    overlap: float  # mean us it started before the previous kernel ended (negative: a gap)

    @property
    def per_step_us(self) -> float:
        return self.per_step * self.increment


@dataclass(frozen=True)
class Timeline:
    steps: int
    step_us: float  # median of the steps' end-to-end times
    step_mean_us: float  # their mean: the sum of every kernel's increments per step
    costs: tuple[KernelCost, ...]  # most costly first
    sequence: tuple[tuple[str, float, float], ...]  # one step in order: (name, start, end) from the previous end


def short_name(name: str) -> str:
    """A kernel's name without its argument list (templated torch kernels), at most 60 characters."""
    return name.split("(")[0][:60]


def critical_path(kernels: list[Kernel], step_marker: str) -> Timeline:
    """Increments per kernel name over the whole steps in `kernels` (a step begins with a kernel whose name holds
    `step_marker`; the first and last, possibly partial, steps are dropped). ValueError with fewer than three
    markers (no whole step between two partial ones)."""
    ks = sorted(kernels, key=lambda k: k.start)
    marks = [i for i, k in enumerate(ks) if step_marker in k.name]
    if len(marks) < 3:
        raise ValueError(f"need at least 3 kernels named *{step_marker}* (whole steps), found {len(marks)}")
    inc, dur, ovl = defaultdict(list), defaultdict(list), defaultdict(list)
    step_times = []
    # whole steps: from marker a (its predecessor's end is the step's origin) up to the next marker
    for a, b in zip(marks[1:-1], marks[2:]):
        seg = ks[a - 1:b]
        step_times.append(seg[-1].end - seg[0].end)
        for prev, k in zip(seg, seg[1:]):
            n = short_name(k.name)
            inc[n].append(k.end - prev.end)
            dur[n].append(k.dur)
            ovl[n].append(prev.end - k.start)
    steps = len(step_times)
    costs = [KernelCost(n, len(inc[n]) / steps, statistics.mean(inc[n]), statistics.mean(dur[n]),
                        statistics.mean(ovl[n])) for n in inc]
    costs.sort(key=lambda c: -c.per_step_us)
    first = ks[marks[1] - 1:marks[2]]
    seq = tuple((short_name(k.name), k.start - p.end, k.end - p.end) for p, k in zip(first, first[1:]))
    return Timeline(steps, statistics.median(step_times), statistics.mean(step_times), tuple(costs), seq)


def kernels_from_trace(path: str) -> list[Kernel]:
    """The GPU kernels of a chrome trace written by torch.profiler (events of category "kernel")."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"]


def format_timeline(t: Timeline, sequence_rows: int = 16) -> str:
    """The costs as a text table, most costly first, then the first `sequence_rows` kernels of one step in order."""
    lines = [f"step {t.step_us:.1f} us (median of {t.steps} whole steps); per kernel: launches per step, "
             f"critical-path increment, duration, overlap with the previous kernel (us)",
             f"{'kernel':60s} {'/step':>6s} {'incr':>8s} {'dur':>8s} {'overlap':>8s} {'us/step':>9s}"]
    for c in t.costs:
        lines.append(f"{c.name:60s} {c.per_step:6.0f} {c.increment:8.2f} {c.duration:8.2f} {c.overlap:8.2f} "
                     f"{c.per_step_us:9.1f}")
    lines.append(f"one step in order (start and end from the previous kernel's end, us), first {sequence_rows}:")
    for name, s, e in t.sequence[:sequence_rows]:
        lines.append(f"  {name:60s} {s:+8.2f} {e:+8.2f}")
    return "\n".join(lines)
