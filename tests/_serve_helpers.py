"""Comparing a greedy answer with another one (batched against alone, the engine against the CPU reference)."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3  # logits closer than this may swap places between two batch compositions (kernels round apart)


def assert_same_greedy(model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """got == want, or they part at a position where the two tokens' logits tie within NEAR_TIE (what rows decoded
    in another batch, with other kernels, may do): the same up to there is what scheduling must get right."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"lengths differ: {len(got)} != {len(want)}"
    with torch.no_grad():
        logits = model.forward(torch.tensor([list(prompt) + want[:i]]))[0, -1].float()  # [V]
    a, b = float(logits[got[i]]), float(logits[want[i]])
    top = float(logits.max())
    assert abs(a - b) < NEAR_TIE * max(1.0, abs(top)) and max(a, b) >= top - NEAR_TIE * max(1.0, abs(top)), (
        f"token {i}: got {got[i]} ({a:.5f}), alone {want[i]} ({b:.5f}), best logit {top:.5f}: not a near tie")
