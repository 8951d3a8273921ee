"""kernels_cu/lab/prefill_gaps.py on the CPU: the union of GPU activities, the holes in it, and a trace's parsing."""

import json

import pytest

from kernels_cu.lab import prefill_gaps as pg

A = pg.Activity


def test_busy_is_the_union_and_gaps_name_their_neighbours():
    acts = [A("k1", 10, 5), A("k2", 12, 10), A("memcpy", 30, 5), A("k3", 31, 2), A("k4", 40, 1)]
    g = pg.gaps_of(acts)
    assert (g.span_us, g.busy_us, g.summed_us) == (31, 18, 23)
    assert g.largest == ((8, "k2", "memcpy"), (5, "memcpy", "k4"))  # k3 lies inside memcpy: not the neighbour
    assert g.by_name[0] == ("k2", 10, 1) and g.activities == 5


def test_an_activity_inside_another_adds_nothing():
    g = pg.gaps_of([A("long", 0, 20), A("inner", 5, 3), A("after", 20, 4)])
    assert (g.busy_us, g.span_us, g.largest) == (24, 24, ())


def test_trace_reading_takes_the_gpu_categories(tmp_path):
    events = [{"name": "prefill", "ph": "X", "ts": 100.0, "dur": 50.0, "cat": "user_annotation"},
              {"name": "gemm", "ph": "X", "ts": 110.0, "dur": 20.0, "cat": "kernel"},
              {"name": "Memcpy HtoD", "ph": "X", "ts": 105.0, "dur": 1.0, "cat": "gpu_memcpy"},
              {"name": "cudaLaunchKernel", "ph": "X", "ts": 104.0, "dur": 3.0, "cat": "cuda_runtime"}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert sorted(a.name for a in pg.read_trace(str(path))) == ["Memcpy HtoD", "gemm"]


def test_no_activity_is_one_clear_exit():
    with pytest.raises(SystemExit, match="no GPU activity"):
        pg.gaps_of([])
