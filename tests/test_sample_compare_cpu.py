"""kernels_cu/lab/sample_compare.py on the CPU: its logits cover what they claim, and a comparison flags any change."""

import torch

from kernels_cu.lab import sample_compare as sc


def test_logit_kinds_hold_what_they_claim():
    g = torch.Generator().manual_seed(0)
    few = sc.make_logits("few", 2, 4096, 1.0, g)
    assert few.shape == (2, 4096) and few.unique().numel() <= 11  # six magnitudes, both signs
    grid = sc.make_logits("grid", 2, 1000, 1.0, g)
    assert torch.equal(grid, grid.half().float())
    nan = sc.make_logits("naninf", 4, 32000, 1.0, g)
    signed_nan = (nan.view(torch.int32) == -1).any()
    assert torch.isnan(nan).any() and torch.isposinf(nan).any() and torch.isneginf(nan).any() and signed_nan
    bits = sc.make_logits("bits", 2, 1000, 1.0, g)
    assert torch.isfinite(bits).all()
    t = 0.37
    edges = sc.make_logits("edges", 2, 1000, t, g) / t  # a few ulps from +-2^e once divided by t
    e = torch.round(torch.log2(edges.abs()))
    assert ((edges.abs() / torch.exp2(e) - 1).abs() < 1e-5).all()


def test_cases_skip_fp16_float_bits():
    cases = sc.cases()
    assert not any(kind == "bits" and dt == torch.float16 for _, dt, kind, _ in cases)
    assert len(cases) == len(sc.VOCABS) * (2 * len(sc.KINDS) - 1) * len(sc.CONFIGS)


def test_differing_flags_changed_missing_and_extra_cases():
    a = {"x": [torch.tensor([1, 2])], "y": [torch.tensor([3])], "z": [torch.tensor([0])]}
    b = {"x": [torch.tensor([1, 2])], "y": [torch.tensor([4])], "w": [torch.tensor([0])]}
    assert sc.differing(a, b) == (["y", "z"], ["w"])
    assert sc.differing(a, dict(a)) == ([], [])
