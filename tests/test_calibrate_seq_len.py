"""calibrate's window length fits the model: the default is 512 tokens or the whole context if shorter, and a
longer --seq-len is refused in one line, the line eval gives for it."""

from __future__ import annotations

import pytest

from calibrate.calibration import DEFAULT_SEQ_LEN, DataConfig, fit_seq_len
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from tests.test_cli import assert_one_line_error, fllama

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=64, name="short-context-tiny")  # conftest's model_dir: a context under 512


def test_fit_seq_len():
    assert fit_seq_len(None, 8192) == DEFAULT_SEQ_LEN == 512 and fit_seq_len(None, 64) == 64
    assert fit_seq_len(64, 64) == 64
    with pytest.raises(ConfigError, match="beyond the model's context of 64 tokens: use --seq-len 64 or less"):
        fit_seq_len(65, 64)
    assert DataConfig().seq_len is None
    with pytest.raises(ConfigError, match="seq-len must be >= 2"):
        DataConfig(seq_len=1)


def test_calibrate_default_windows_fit_a_short_context(capsys, monkeypatch, model_dir, text_file, tmp_path):
    out = tmp_path / "s.safetensors"
    code, _, err = fllama(capsys, monkeypatch, "calibrate", model_dir, "--data", text_file, "--samples", "2",
                          "--method", "max", "-o", out, "--device", "cpu")
    assert code == 0, err
    from calibrate.stats import CalibStats

    meta = CalibStats.load(out).meta
    assert meta["seq_len"] == 64 and meta["tokens"] == 2 * 64


def test_calibrate_and_eval_refuse_a_window_beyond_the_context_alike(capsys, monkeypatch, model_dir, text_file,
                                                                      tmp_path):
    lines = []
    for args in (("calibrate", model_dir, "--data", text_file, "--seq-len", "65", "-o", tmp_path / "s.safetensors"),
                 ("eval", model_dir, "--data", text_file, "--seq-len", "65")):
        code, _, err = fllama(capsys, monkeypatch, *args, "--device", "cpu")
        assert_one_line_error(code, err, "beyond the model's context of 64 tokens")
        lines.append(err.strip())
    assert lines[0] == lines[1]
    assert not (tmp_path / "s.safetensors").exists()


def test_calibration_windows_default_to_the_context(model_dir, text_file):
    """The library's default too (DataConfig without a seq_len), not only the CLI's."""
    from calibrate.calibration import calibration_windows
    from model_zoo.load import load_model

    loaded = load_model(str(model_dir))
    windows = calibration_windows(loaded.tokenizer, DataConfig(source=str(text_file), samples=3), CFG.max_positions)
    assert tuple(windows.shape) == (3, 64)
