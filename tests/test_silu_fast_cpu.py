"""kernels_cu/silu_fast.cuh's bracket, emulated in numpy on the CPU for all 65,536 fp16 inputs: where the fast path
keeps its result (both ends of q's interval round to one fp16) that result is torch's fp16 F.silu, the special values
(zeros, infinities, NaN) fall back, and the fallback is rare on gate-like values. ex2.approx and rcp.approx are taken
as correctly rounded here, so this checks the bracket's logic and constants; tests/gpu/test_silu_mul.py checks the
hardware on every input."""

import re
from pathlib import Path

import numpy as np
import torch
from torch.nn.functional import silu

HEADER = Path(__file__).resolve().parents[1] / "kernels_cu" / "silu_fast.cuh"


def constant(name: str) -> np.float32:
    m = re.search(rf"constexpr float {name} = ([-0-9.e]+)f;", HEADER.read_text())
    assert m, f"{name} not found in {HEADER.name}"
    return np.float32(float(m.group(1)))


def f32(x) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32)


def ftz(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < np.float32(2.0 ** -126), np.copysign(np.float32(0), x), x)


def emulated_bracket(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fast path's fp16 bits, whether it keeps them) for fp32 inputs g, every fp32 step rounded once."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):  # NaN inputs signal
        gd = g.astype(np.float64)
        t = f32(gd * np.float64(constant("NEG_LOG2E")))
        d = f32(1.0 + ftz(f32(np.exp2(t.astype(np.float64)))).astype(np.float64))
        q = f32(gd * ftz(f32(1.0 / d.astype(np.float64))).astype(np.float64))
        eps = f32(np.abs(gd) * np.float64(constant("SILU_EPS_G")) + np.float64(constant("SILU_EPS_0")))
        qd, ed = q.astype(np.float64), eps.astype(np.float64)
        lo = f32(-qd * ed + qd).astype(np.float16).view(np.uint16)
        hi = f32(qd * ed + qd).astype(np.float16).view(np.uint16)
    return lo, lo == hi


def test_fast_path_keeps_only_silu_h_bits():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)  # every fp16 pattern
    want = silu(torch.from_numpy(h.copy())).numpy()  # fp32 formula, one rounding
    with np.errstate(invalid="ignore"):
        got, kept = emulated_bracket(h.astype(np.float32))
    same = (got == want.view(np.uint16)) | (np.isnan(got.view(np.float16)) & np.isnan(want))
    wrong = kept & ~same
    assert not wrong.any(), f"{int(wrong.sum())} kept values differ, e.g. g = {h[wrong][:4].tolist()}"
    # where the fast formula goes wrong the bracket must let go: -0 (its ends are +0 and -0), +inf (NaN and inf)
    assert not kept[(h == 0) & np.signbit(h)].any() and not kept[np.isposinf(h)].any()
    assert kept.sum() > 45_000, kept.sum()


def test_fallback_is_rare_on_gate_values():
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(200_000).astype(np.float32) * 3).astype(np.float16)  # prefill-like gate values
    _, kept = emulated_bracket(g.astype(np.float32))
    assert 1.0 - kept.mean() < 0.005, f"{100 * (1 - kept.mean()):.3f}% fall back"
