"""awq_chain without a GPU: where it runs, how its Phase arguments pack, and (with nvcc) ptxas's report on its
entry: no spills, two resident blocks of 256 threads (the grid barrier needs every block resident, and the
launcher sizes the grid from that)."""

from __future__ import annotations

import re
import struct
import subprocess

import pytest
import torch

from kernels_cu import awq_chain, build, launch_ex
from kernels_cu.awq_gemv import AwqPacked


def op(k: int, n: int, gs: int = 128, swiglu: bool = False) -> AwqPacked:
    empty = torch.empty(0, dtype=torch.int32)
    return AwqPacked(empty, empty, n, k, gs, gs, swiglu)


def test_where_the_chain_runs():
    ops = [op(4096, 4096), op(4096, 22016, swiglu=True), op(11008, 4096), op(4096, 12288)]
    assert all(awq_chain.takes(m, ops) for m in (1, 4, 8))
    assert not awq_chain.takes(0, ops) and not awq_chain.takes(9, ops)  # one token tile of 8
    assert not awq_chain.takes(1, ops[:2] + [op(11008, 4096, gs=64)])  # the _g1 body only


def test_phase_arguments_pack_like_the_struct():
    """struct Phase {5 pointers; 3 ints; 4 pointers} is 88 bytes with the second group of pointers at 56 (C's
    alignment, which arg_format reproduces); the entry's scalars follow the four phases at 352."""
    assert struct.calcsize(launch_ex.arg_format(awq_chain.PHASE_SIGNATURE)) == 88
    fmt = launch_ex.arg_format(awq_chain.SIGNATURE)
    args = list(range(1, len(awq_chain.SIGNATURE) + 1))
    args[-2] = 0.5  # eps
    buf = struct.pack(fmt, *args)
    assert struct.unpack_from("<Q", buf, 56)[0] == 9  # p0.fold_w, after N, K, tiles and 4 bytes of padding
    assert struct.unpack_from("<Q", buf, 88)[0] == 13  # p1.y
    assert struct.unpack_from("<iif", buf, 352) == (49, 50, 0.5)  # phases, M, eps
    assert struct.unpack_from("<Q", buf, 368)[0] == 52 and len(buf) == 376  # the barrier word


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")
def test_entry_compiles_for_two_resident_blocks(tmp_path):
    cmd = [build.find_nvcc(), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *build.BASE_OPTIONS, "-Xptxas",
           "-v", f"-I{build.KERNEL_DIR}", "-o", str(tmp_path / "a.cubin"), str(build.KERNEL_DIR / "awq_chain.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = proc.stderr.split(f"Compiling entry function '{awq_chain.ENTRY}'")[1]
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in text, text
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    smem = int(re.search(r"(\d+) bytes smem", text).group(1))
    assert regs * awq_chain.THREADS * awq_chain.BLOCKS_PER_SM <= 65536, regs
    assert smem * awq_chain.BLOCKS_PER_SM <= 227 * 1024, smem
