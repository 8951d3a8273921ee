"""GPU test fixtures: skip without a usable GPU stack, run every test on fllama's stream, compare and poison.

Every test here is marked `gpu`; run them with `pytest -m gpu` on a machine with an NVIDIA GPU, the CUDA
toolkit (nvcc) and pycuda. Elsewhere the modules skip at collection.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

GPU_STACK = torch.cuda.is_available() and importlib.util.find_spec("pycuda") is not None
SKIP_REASON = "needs a CUDA GPU visible to torch and pycuda"


@pytest.fixture(autouse=True)
def cuda():
    """Skip unless the build layer is usable; run the test with fllama's stream as torch's current stream."""
    if not GPU_STACK:
        pytest.skip(SKIP_REASON)
    from kernels_cu import build
    from model_zoo.errors import DeviceError
    try:
        build.require_cuda()
    except DeviceError as e:
        pytest.skip(str(e))
    with build.on_stream():
        yield torch.device("cuda")
        build.synchronize()


def compare(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float = 0.0, what: str = "") -> None:
    """Assert |out - ref| <= atol + rtol * |ref| element-wise (NaN fails); report the worst element."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double().cpu().contiguous(), ref.double().cpu().contiguous()
    err = (o - r).abs()
    excess = err - (atol + rtol * r.abs())
    excess = torch.where(torch.isnan(excess), torch.full_like(excess, float("inf")), excess)
    worst = int(excess.argmax())
    if excess.view(-1)[worst] > 0:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
        n_bad = int((excess > 0).sum())
        raise AssertionError(
            f"{what}: {n_bad}/{out.numel()} elements out of tolerance (rtol={rtol}, atol={atol}); worst at {idx}: "
            f"got {o.view(-1)[worst].item():.6g}, want {r.view(-1)[worst].item():.6g}; "
            f"max abs err {float(torch.nan_to_num(err, nan=float('inf')).max()):.3g}")


POISON = {torch.float16: float("nan"), torch.float32: float("nan"), torch.int8: -128,
          torch.uint8: 0xAB, torch.int32: 0x7F7F7F7F, torch.int64: 0x7F7F7F7F7F7F}


def poison(*tensors: torch.Tensor) -> None:
    """Fill outputs with a value no kernel writes (NaN; -128 for int8, which quantization never produces)."""
    for t in tensors:
        t.fill_(POISON[t.dtype])


def assert_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Bitwise equality, reporting the first mismatches."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape}/{out.dtype} vs {ref.shape}/{ref.dtype}"
    o, r = out.cpu(), ref.cpu()
    same = (o == r) | (torch.isnan(o) & torch.isnan(r)) if o.is_floating_point() else (o == r)
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        vals = [(tuple(i), o[tuple(i)].item(), r[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{what}: {int((~same).sum())}/{o.numel()} elements differ; first (index, got, want): {vals}")


def randn(*shape: int, scale: float = 1.0, seed: int = 0, dtype=torch.float16) -> torch.Tensor:
    """Fresh random values on the GPU (a CPU generator keeps them reproducible); never all zeros."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()


def awq_tensors(K: int, N: int, G: int, seed: int):
    """Random AutoAWQ-GEMM tensors: packed words (every nibble value, incl. zero points 0 and 15) and positive
    fp16 scales: qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N] on the GPU."""
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31, (K, N // 8), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31, (K // G, N // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(K // G, N, generator=g) * 0.02 + 1e-3).to(torch.float16)
    return qweight.cuda(), qzeros.cuda(), scales.cuda()


def check_gemm(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """A fp16 GEMM output against its float64 reference: finite, element-wise within 2e-3 (relative, and of
    the rms), and 1e-3 relative in norm."""
    assert bool(torch.isfinite(y).all()), what
    rms = float(ref.float().pow(2).mean().sqrt())
    compare(y, ref, rtol=2e-3, atol=2e-3 * rms, what=what)
    rel = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-3, f"{what}: relative error {rel:.2e}"


def check_swiglu(y: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """silu(gate) * up multiplies two computed sums, each carrying a GEMM's error (2e-3 of its rms): the bound
    is that error propagated through the product (|silu'| <= 1.1), plus fp16 rounding of the result."""
    gate, up = gate.double(), up.double()
    eg, eu = 2e-3 * float(gate.pow(2).mean().sqrt()), 2e-3 * float(up.pow(2).mean().sqrt())
    bound = eg * 1.1 * up.abs() + torch.nn.functional.silu(gate).abs() * eu + 2e-3 * ref.double().abs() + eg * eu
    err = (y.double() - ref.double()).abs()
    assert bool((err <= bound).all()), f"{what}: worst excess {float((err - bound).max()):.3g}"
