"""Sampling functions: known answers."""

import pytest
import torch

from model_zoo.errors import ConfigError
from model_zoo.sampling import SamplingConfig, TorchSampler, apply_repetition_penalty, filter_top_k_top_p


def test_repetition_penalty_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    k2 = filter_top_k_top_p(logits, 2, 1.0)
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = filter_top_k_top_p(logits, 0, 0.8)  # 0.5 + 0.2 = 0.7 < 0.8 -> third token needed
    assert torch.isfinite(p[0, :3]).all() and torch.isinf(p[0, 3:]).all()
    tiny = filter_top_k_top_p(logits, 0, 0.01)  # the top token always stays
    assert torch.isfinite(tiny[0, 0]) and torch.isinf(tiny[0, 1:]).all()


def test_sampler_greedy_and_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    greedy = TorchSampler(SamplingConfig(temperature=0), 1, 6)
    assert greedy.sample(logits, [0]).item() == logits.argmax().item()
    s = TorchSampler(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=1), 1, 6)
    draws = torch.stack([s.sample(logits, [0]) for _ in range(6000)]).flatten()
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.03


def test_config_errors():
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"repetition_penalty": 0}):
        with pytest.raises(ConfigError):
            SamplingConfig(**bad)
