"""Perplexity over non-overlapping windows, and agreement with a baseline model (KL, top-1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError


@dataclass(frozen=True)
class EvalConfig:
    seq_len: int = 512
    max_tokens: int = 4096
    batch: int = 1  # windows per forward

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"seq-len must be >= 2, got {self.seq_len}")
        if self.max_tokens < self.seq_len:
            raise ConfigError(f"max-tokens ({self.max_tokens}) must be at least seq-len ({self.seq_len})")
        if self.batch < 1:
            raise ConfigError("batch must be >= 1")


def check_window_fits(seq_len: int, config: LlamaConfig, which: str = "the model") -> None:
    """A window is one forward pass: it must fit the context (calibrate refuses the same)."""
    if seq_len > config.max_positions:
        raise ConfigError(f"--seq-len {seq_len} is beyond {which}'s context of {config.max_positions} tokens: "
                          f"use --seq-len {config.max_positions} or less")


def check_baseline(config: LlamaConfig, tokenizer: Any, base_config: LlamaConfig, base_tokenizer: Any,
                   text: str) -> None:
    """KL and top-1 agreement compare the two models token by token: both must read the text as the same ids."""
    if base_config.vocab_size != config.vocab_size:
        raise ConfigError(f"the baseline's vocabulary ({base_config.vocab_size}) differs from the model's "
                          f"({config.vocab_size})")
    sample = text[:4000]
    if base_tokenizer.encode(sample) != tokenizer.encode(sample):
        raise ConfigError("the baseline's tokenizer splits the text differently from the model's: a baseline must "
                          "share the model's tokenizer (e.g. the model before quantization)")


@dataclass
class EvalResult:
    perplexity: float
    nll: float  # mean negative log-likelihood (nats / token)
    tokens: int  # tokens scored
    windows: int
    seq_len: int
    kl_divergence: float | None = None  # mean KL(baseline || model) per scored token
    top1_agreement: float | None = None
    baseline_perplexity: float | None = None

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("perplexity", "nll", "tokens", "windows", "seq_len",
                                              "kl_divergence", "top1_agreement", "baseline_perplexity")}


def evaluate(model: Any, windows: torch.Tensor, cfg: EvalConfig, baseline: Any = None,
             progress: Callable[[int], None] | None = None) -> EvalResult:
    """windows [n, seq_len]: each window scores its tokens 2..L from the logits at 1..L-1.

    `model` and `baseline` are backends (forward(tokens [B, S]) -> logits [B, S, V]).
    """
    for backend, which in ((model, "the model"), (baseline, "the baseline")):
        if backend is not None:
            check_window_fits(windows.shape[1], backend.config, which)
            check_token_ids(windows, backend.config.vocab_size, "the evaluation text")
    nll_sum, kl_sum, agree, count = 0.0, 0.0, 0, 0
    base_nll = 0.0
    for start in range(0, len(windows), cfg.batch):
        chunk = windows[start:start + cfg.batch]  # [b, L]
        target = chunk[:, 1:]  # [b, L-1]
        logp = _log_probs(model, chunk)  # [b, L-1, V]
        nll_sum += float(-logp.gather(-1, target[..., None].to(logp.device)).sum())
        if baseline is not None:
            base_logp = _log_probs(baseline, chunk).to(logp.device)  # [b, L-1, V]
            base_nll += float(-base_logp.gather(-1, target[..., None].to(logp.device)).sum())
            kl_sum += float((base_logp.exp() * (base_logp - logp)).sum())
            agree += int((base_logp.argmax(-1) == logp.argmax(-1)).sum())
        count += target.numel()
        if progress:
            progress(len(chunk))
    nll = nll_sum / count
    result = EvalResult(perplexity=math.exp(nll), nll=nll, tokens=count, windows=len(windows), seq_len=windows.shape[1])
    if baseline is not None:
        result.kl_divergence = kl_sum / count
        result.top1_agreement = agree / count
        result.baseline_perplexity = math.exp(base_nll / count)
    return result


def _log_probs(model: Any, chunk: torch.Tensor) -> torch.Tensor:
    logits = model.forward(chunk)[:, :-1]  # [b, L-1, V]
    return torch.log_softmax(logits.float(), dim=-1)
