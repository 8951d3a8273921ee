"""kernels_cu.lab.timeline: critical-path increments of overlapping kernels (CPU, synthetic traces)."""

import json

import pytest

from kernels_cu.lab.timeline import Kernel, critical_path, format_timeline, kernels_from_trace


def _step(t0: float) -> list[Kernel]:
    # embedding 2 us; gemv starts 1 us before it ends (programmatic launch) and runs 10 us; attention starts 3 us
    # before the GEMV ends and ends 4 us after it; a gap of 0.5 us, then sampling for 2 us
    return [Kernel("embedding_i32", t0, 2.0), Kernel("gemv(int, int)", t0 + 1.0, 10.0),
            Kernel("attn", t0 + 8.0, 7.0), Kernel("sample", t0 + 15.5, 2.0)]


def test_increments_add_up_to_the_step():
    kernels = [k for i in range(5) for k in _step(100.0 * i)]
    t = critical_path(kernels[::-1], "embedding")  # any order in: sorted by start
    assert t.steps == 3  # the first and last steps dropped
    cost = {c.name: c for c in t.costs}
    assert cost["gemv"].increment == pytest.approx(9.0)  # ends 9 us after the embedding
    assert cost["gemv"].overlap == pytest.approx(1.0)
    assert cost["attn"].increment == pytest.approx(4.0) and cost["attn"].duration == pytest.approx(7.0)
    assert cost["sample"].increment == pytest.approx(2.5) and cost["sample"].overlap == pytest.approx(-0.5)
    # the step runs from the previous step's last end (17.5) to this step's (117.5)
    assert t.step_us == pytest.approx(100.0)
    assert sum(c.per_step_us for c in t.costs) == pytest.approx(t.step_mean_us)
    assert t.step_mean_us == pytest.approx(t.step_us)  # equal steps
    assert [c.name for c in t.costs][0] == "embedding_i32"  # 100 - 17.5 + 2: the idle gap between steps counts
    assert t.sequence[1] == ("gemv", pytest.approx(-1.0), pytest.approx(9.0))


def test_too_few_steps():
    with pytest.raises(ValueError, match="at least 3"):
        critical_path(_step(0.0) + _step(100.0), "embedding")


def test_trace_file(tmp_path):
    events = [{"cat": "kernel", "name": k.name, "ts": k.start, "dur": k.dur} for i in range(4) for k in _step(50.0 * i)]
    events.append({"cat": "cpu_op", "name": "aten::copy_", "ts": 1.0, "dur": 1.0})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kernels = kernels_from_trace(str(path))
    assert len(kernels) == 16
    text = format_timeline(critical_path(kernels, "embedding"))
    assert "step 50.0 us (median of 2 whole steps)" in text and "attn" in text
