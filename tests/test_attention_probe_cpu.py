"""kernels_cu.lab.attention_probe's arithmetic on made-up stamps (the probe itself needs a GPU)."""

import math
import os

import pytest
import torch

from kernels_cu.lab import attention_probe as ap


def stamps(rows: list[list[int]]) -> torch.Tensor:
    t = torch.zeros(len(rows) + 2, ap.SLOTS, dtype=torch.int64)  # two blocks that never ran: all zeros
    for i, r in enumerate(rows):
        t[i, :len(r)] = torch.tensor(r)
    return t


def test_phase_times_are_relative_to_the_first_entry_and_skip_missing_phases():
    # ns stamps; block 2 left after phase 1 (past the row's end), block 1 entered first
    s = stamps([[1_200, 2_200, 3_200, 5_200, 6_000, 7_000, 8_000, 9_000],
                [1_000, 2_000, 4_000, 5_000, 5_500, 6_500, 7_500, 8_500],
                [1_100, 2_400]])
    out = ap.phase_times(s)
    assert len(out) == len(ap.PHASES)
    med0, last0, n0 = out[0]
    assert n0 == 3 and math.isclose(med0, 0.1) and math.isclose(last0, 0.2)
    med1, last1, n1 = out[1]
    assert n1 == 3 and math.isclose(med1, 1.2) and math.isclose(last1, 1.4)
    med2, last2, n2 = out[2]  # two blocks: torch's median is the lower one
    assert n2 == 2 and math.isclose(med2, 2.2) and math.isclose(last2, 3.0)
    assert out[7][2] == 2 and math.isclose(out[7][1], 8.0)


def test_role_times_split_each_unit_into_block_0_the_middle_and_the_new_token_block():
    # 2 units of S = 4 blocks (grid (S, units): block u * S + split); unit 0 has 3 active blocks (copies issued,
    # phase 2), unit 1 all 4; idle blocks stamp only their entry
    rows = []
    for u in range(2):
        for split in range(4):
            active = split < (3 if u == 0 else 4)
            entry = 1_000 + 100 * u
            rows.append([entry, entry + 500, entry + 2_000 + 300 * split] if active else [entry])
    out = ap.role_times(stamps(rows), units=2)
    assert len(out) == len(ap.PHASES)
    block0, middle, new = out[2]
    assert math.isclose(block0, 2.05)  # (2.0 + 2.1) / 2: the median of the units' block 0
    assert math.isclose(new, (2.6 + 3.0) / 2)  # unit 0's split 2, unit 1's split 3
    assert math.isclose(middle, (2.3 + 2.4) / 2)  # unit 0: split 1 alone; unit 1: splits 1-2 (2.4, 2.7), the lower
    assert all(math.isnan(v) for v in out[5])  # a phase no block reached


def test_importing_the_probe_sets_no_compiler_flag():
    """Only main() adds -DFLLAMA_ATTN_PROBE: an import (this test process) must not change what build.py compiles."""
    assert ap.PROBE_FLAG not in os.environ.get("FLLAMA_NVCC_FLAGS", "")


@pytest.mark.parametrize("off", ["attention_splits", "awq_gemv_max_m"])
def test_off_takes_only_a_tuning_boolean(off):
    """--off names a Tuning boolean; anything else stops in one line, before the compiler flag is set."""
    with pytest.raises(SystemExit, match="Tuning boolean"):
        ap.main(["--off", off])
    assert ap.PROBE_FLAG not in os.environ.get("FLLAMA_NVCC_FLAGS", "")
