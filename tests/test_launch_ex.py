"""Programmatic dependent launch on the CPU side: the ctypes structs match cuda.h, arguments pack as the
kernels expect, `build.programmatic()` scopes correctly, and every kernel waits before it reads."""

from __future__ import annotations

import ctypes
import re
import struct

import pytest
import torch

from kernels_cu import build, kernel_function, launch_ex
from kernels_cu.build import KERNEL_DIR


def test_structs_have_cuda_h_layout():
    # sizeof / offsetof printed by a C program compiled against CUDA 13.0's cuda.h
    A, C = launch_ex.LaunchAttribute, launch_ex.LaunchConfig
    assert (ctypes.sizeof(A), A.value.offset) == (72, 8)
    assert (ctypes.sizeof(C), C.hStream.offset, C.attrs.offset, C.numAttrs.offset) == (56, 32, 40, 48)


def test_arguments_pack_with_c_alignment():
    # (void*, int, void*): the second pointer starts at 16, after 4 bytes of padding
    buf = struct.pack(launch_ex.arg_format("PiP"), 0x1122334455667788, -5, 7)
    assert len(buf) == 24
    assert struct.unpack_from("<Q", buf, 0)[0] == 0x1122334455667788
    assert struct.unpack_from("<i", buf, 8)[0] == -5
    assert struct.unpack_from("<Q", buf, 16)[0] == 7
    # the rmsnorm entry (PPPPPPPif): the trailing float sits right after the int
    buf = struct.pack(launch_ex.arg_format("PPPPPPPif"), 1, 2, 3, 4, 5, 6, 7, 4096, 1e-5)
    assert len(buf) == 64 and struct.unpack_from("<f", buf, 60)[0] == pytest.approx(1e-5)


def test_programmatic_scope_nests_and_unwinds(monkeypatch):
    monkeypatch.setenv("FLLAMA_PDL", "0")  # off: answers without asking the (absent) GPU
    assert not build.programmatic_active()
    with build.programmatic():
        with build.programmatic():
            pass
        assert kernel_function._local.depth == 1
    assert kernel_function._local.depth == 0
    with pytest.raises(RuntimeError):
        with build.programmatic():
            raise RuntimeError("boom")
    assert kernel_function._local.depth == 0


def _entries(text: str):
    """(entry text, body) of every extern "C" __global__ function, macro continuations removed."""
    text = text.replace("\\\n", "\n")
    for m in re.finditer(r'extern "C" __global__', text):
        open_ = text.index("{", text.index(")", m.end()))
        depth, i = 0, open_
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        yield text[m.start():open_], text[open_:i + 1]


_WAITS = re.compile(r"pdl_(enter\w*|wait)\([^;]*\);")  # pdl_gemv_started and pdl_enter_attention take rows


def _waits(body: str, text: str, depth: int = 2) -> bool:
    """The body calls pdl_wait / pdl_enter*, itself or in a template function it calls (depth levels down)."""
    if _WAITS.search(body):
        return True
    for fn in re.findall(r"(\w+)\s*<[^;(]*>\s*\(", body) if depth else []:
        definition = re.search(rf"void {fn}\s*\(.*?\n}}\n", text, re.S)
        if definition and _waits(definition.group(0), text, depth - 1):
            return True
    return False


def test_every_kernel_waits_for_the_previous_grid():
    """A kernel launched programmatically that reads before griddepcontrol.wait would race: each entry calls
    pdl_enter(), or a device function that calls pdl_wait() (the GEMVs, after their first weight loads)."""
    files = sorted(KERNEL_DIR.glob("*.cu"))
    assert len(files) >= 10
    n = 0
    for f in files:
        text = build.source_text(f.name)  # with the headers it includes
        for head, body in _entries(f.read_text()):
            n += 1
            assert _waits(body, text), f"{f.name}: {head[:80]} never calls pdl_wait()"
    assert n >= 18


def test_launcher_fills_config_attribute_and_argument_buffer(monkeypatch):
    seen = []

    class FakeDriver:
        def cuLaunchKernelEx(self, cfg_ref, fn, params, extra):
            cfg = cfg_ref._obj
            attr = cfg.attrs[0]
            size = ctypes.c_size_t.from_address(extra[3]).value
            seen.append(dict(grid=(cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), block=(cfg.blockDimX, cfg.blockDimY,
                             cfg.blockDimZ), shared=cfg.sharedMemBytes, stream=cfg.hStream, n_attrs=cfg.numAttrs,
                             attr=(attr.id, attr.value), fn=fn, params=params, keys=(extra[0], extra[2], extra[4]),
                             args=ctypes.string_at(extra[1], size)))
            return 0

    monkeypatch.setattr(launch_ex, "_lib", lambda: FakeDriver())
    launch = launch_ex.ExLauncher(0xF00, "k", "PiPf")
    launch((3, 2, 1), (128, 1, 1), 0xABC, 4096, [0x1000, 7, 0x2000, 0.5])
    launch((5, 1, 1), (256, 1, 1), 0xABC, 0, [0x3000, -1, 0, 2.0])  # buffers are refilled, not appended
    first, second = seen
    assert first["grid"] == (3, 2, 1) and first["block"] == (128, 1, 1) and first["shared"] == 4096
    assert first["stream"] == 0xABC and first["fn"] == 0xF00 and first["params"] is None
    assert first["n_attrs"] == 1 and first["attr"] == (launch_ex.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert first["keys"] == (launch_ex.CU_LAUNCH_PARAM_BUFFER_POINTER, launch_ex.CU_LAUNCH_PARAM_BUFFER_SIZE, None)
    assert first["args"] == struct.pack("@PiPf", 0x1000, 7, 0x2000, 0.5)
    assert second["grid"] == (5, 1, 1) and second["args"] == struct.pack("@PiPf", 0x3000, -1, 0, 2.0)


def test_launcher_passes_cluster_dimensions_with_or_without_pdl(monkeypatch):
    seen = []

    class FakeDriver:
        def cuLaunchKernelEx(self, cfg_ref, fn, params, extra):
            cfg = cfg_ref._obj
            seen.append([(cfg.attrs[i].id, cfg.attrs[i].value, cfg.attrs[i].y, cfg.attrs[i].z)
                         for i in range(cfg.numAttrs)])
            return 0

    monkeypatch.setattr(launch_ex, "_lib", lambda: FakeDriver())
    launch = launch_ex.ExLauncher(0xF00, "k", "Pi")
    launch((12, 32, 1), (128, 1, 1), 0, 0, [0, 1], programmatic=False, cluster=(12, 1, 1))
    launch((12, 32, 1), (128, 1, 1), 0, 0, [0, 1], programmatic=True, cluster=(12, 1, 1))
    launch((12, 32, 1), (128, 1, 1), 0, 0, [0, 1])  # the attribute slots are rewritten, not left over
    pdl, cl = launch_ex.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    bal = (launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE, 2, 0, 0)  # load balancing
    assert seen == [[(cl, 12, 1, 1), bal], [(pdl, 1, 0, 0), (cl, 12, 1, 1), bal], [(pdl, 1, 0, 0)]]
    # cuda.h: CUlaunchAttributeValue.clusterDim is {x, y, z} at the start of the union
    A = launch_ex.LaunchAttribute
    assert (A.value.offset, A.y.offset, A.z.offset) == (8, 12, 16)


def test_launcher_keeps_a_repeated_shape_and_rewrites_a_changed_one(monkeypatch):
    seen = []

    class FakeDriver:
        def cuLaunchKernelEx(self, cfg_ref, fn, params, extra):
            cfg = cfg_ref._obj
            seen.append(((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream,
                         [cfg.attrs[i].id for i in range(cfg.numAttrs)],
                         ctypes.string_at(extra[1], ctypes.c_size_t.from_address(extra[3]).value)))
            return 0

    monkeypatch.setattr(launch_ex, "_lib", lambda: FakeDriver())
    launch = launch_ex.ExLauncher(0xF00, "k", "Pi")
    pdl, cl = launch_ex.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    bal = launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
    launch((4, 1, 1), (128, 1, 1), 0xA, 0, [0x10, 1])
    launch((4, 1, 1), (128, 1, 1), 0xA, 0, [0x20, 2])  # same shape: only the arguments change
    launch((8, 2, 1), (256, 1, 1), 0xB, 512, [0x30, 3], programmatic=False, cluster=(2, 1, 1))
    launch((4, 1, 1), (128, 1, 1), 0xA, 0, [0x40, 4])  # back to the first shape: every field rewritten
    launch((4, 1, 1), (128, 1, 1), 0xC, 0, [0x50, 5])  # another stream
    assert seen == [((4, 1, 1), 128, 0, 0xA, [pdl], struct.pack("@Pi", 0x10, 1)),
                    ((4, 1, 1), 128, 0, 0xA, [pdl], struct.pack("@Pi", 0x20, 2)),
                    ((8, 2, 1), 256, 512, 0xB, [cl, bal], struct.pack("@Pi", 0x30, 3)),
                    ((4, 1, 1), 128, 0, 0xA, [pdl], struct.pack("@Pi", 0x40, 4)),
                    ((4, 1, 1), 128, 0, 0xC, [pdl], struct.pack("@Pi", 0x50, 5))]


def test_argument_fast_path_packs_as_the_checked_path_and_falls_back_for_the_rest():
    class GpuTensor(torch.Tensor):  # a tensor that says it is on the GPU, at a known address
        @property
        def is_cuda(self):
            return True

        def data_ptr(self):
            return 0xBEEF

    import numpy as np
    sig = "PPPifqI"
    convs = kernel_function.fast_converters(sig)
    gpu = torch.zeros(2).as_subclass(GpuTensor)
    args = (gpu, None, 0x1234, 7, 0.5, np.int64(3), 2)  # a raw address and a numpy int take the checked path
    want = [0xBEEF, 0, 0x1234, 7, 0.5, 3, 2]
    assert kernel_function._pack_args(convs, sig, "k", args) == want
    assert kernel_function._pack_args(convs, sig, "k", (gpu, None, None, 7, 1, 3, 2)) == [0xBEEF, 0, 0, 7, 1.0, 3, 2]
    with pytest.raises(ValueError, match="argument 0: tensor is on cpu"):
        kernel_function._pack_args(convs, sig, "k", (torch.zeros(2),) + args[1:])
    with pytest.raises(TypeError, match="argument 3: expected an int"):
        kernel_function._pack_args(convs, sig, "k", args[:3] + (True,) + args[4:])
    with pytest.raises(TypeError, match="argument 3: expected an int"):
        kernel_function._pack_args(convs, sig, "k", args[:3] + (7.0,) + args[4:])


def test_launch_dimensions_are_checked_once_and_padded():
    assert kernel_function._dim3((5,)) == (5, 1, 1) and kernel_function._dim3((5,)) == (5, 1, 1)  # the second from the memo
    assert kernel_function._dim3([2, 3]) == (2, 3, 1)
    assert kernel_function._dim3((np_int := __import__("numpy").int32(4), 2)) == (4, 2, 1) and int(np_int) == 4
    for bad in ((0,), (1, 1, 1, 1), ()):
        with pytest.raises(ValueError, match="1 to 3 positive ints"):
            kernel_function._dim3(bad)
