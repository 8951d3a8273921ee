"""The command line end to end on a tiny HF checkpoint: help, success, and one clear line per user error."""

from __future__ import annotations

import json
import sys

import pytest

from fllama_cli.main import main
from model_zoo.config import LlamaConfig
from tests._fixtures_loaders import write_hf_dir

# hidden 64 and ffn 96 are both divisible by the AWQ group 32
CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  rope_theta=50000.0, max_positions=256, name="cli-tiny")


def fllama(capsys, monkeypatch, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["fllama", *map(str, args)])
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 1, err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert "Traceback" not in err and lines and lines[0].startswith("error:"), err
    assert needle.lower() in " ".join(lines).lower(), err


@pytest.mark.parametrize("cmd", ["", "generate", "chat", "eval", "info", "calibrate", "quantize", "bench"])
def test_help(capsys, monkeypatch, cmd):
    code, out, _ = fllama(capsys, monkeypatch, *([cmd] if cmd else []), "--help")
    assert code == 0 and "Usage" in out


def test_generate_json_is_greedy_and_deterministic(capsys, monkeypatch, model_dir):
    args = ["generate", model_dir, "-p", "Holmes said", "-n", "7", "--temperature", "0", "--device", "cpu", "--json"]
    code, out, err = fllama(capsys, monkeypatch, *args)
    assert code == 0, err
    a = json.loads(out)
    assert {"text", "tokens", "prompt_tokens", "generated_tokens", "tokens_per_s"} <= a.keys()
    assert a["generated_tokens"] == len(a["tokens"]) <= 7 and a["prompt_tokens"] > 0
    assert json.loads(fllama(capsys, monkeypatch, *args)[1])["tokens"] == a["tokens"]


def test_generate_batch_and_stdin(capsys, monkeypatch, model_dir):
    code, out, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "a", "-p", "a longer one", "-n", "3",
                            "--temperature", "0", "--device", "cpu", "--json")
    assert code == 0, err and len(json.loads(out)["results"]) == 2
    code, out, err = fllama(capsys, monkeypatch, "generate", model_dir, "-n", "3", "--device", "cpu", "--json",
                            stdin="from stdin")
    assert code == 0 and json.loads(out)["prompt_tokens"] > 0


def test_chat_over_stdin(capsys, monkeypatch, model_dir):
    code, out, err = fllama(capsys, monkeypatch, "chat", model_dir, "-n", "4", "--temperature", "0", "--device", "cpu",
                            stdin="hello\n/reset\nagain\n/exit\nnot read\n")
    assert code == 0, err


def test_info_of_a_random_preset_reads_no_weights(capsys, monkeypatch):
    """A 70B preset is described from its shapes (random weights of it would need 280 GB in fp32)."""
    code, out, err = fllama(capsys, monkeypatch, "info", "llama3.1-70b", "--random", "--json")
    info = json.loads(out)
    assert code == 0 and info["kind"] == "random" and info["layers"] == 80 and info["kv_heads"] == 8
    assert info["weight_bytes"] == 2 * info["parameters"] and 70e9 < info["parameters"] < 71e9


def test_info_json(capsys, monkeypatch, model_dir):
    code, out, err = fllama(capsys, monkeypatch, "info", model_dir, "--json")
    info = json.loads(out)
    assert code == 0 and info["layers"] == 2 and info["kv_heads"] == 2 and info["scheme"] == "fp16"


def test_eval_json_keys(capsys, monkeypatch, model_dir, text_file):
    code, out, err = fllama(capsys, monkeypatch, "eval", model_dir, "--data", text_file, "--seq-len", "64",
                            "--max-tokens", "256", "--device", "cpu", "--json", "--baseline", model_dir)
    r = json.loads(out)
    assert code == 0, err
    assert r["seq_len"] == 64 and r["tokens"] == 4 * 63 and r["perplexity"] > 1
    assert r["kl_divergence"] == pytest.approx(0, abs=1e-6) and r["top1_agreement"] == 1.0


def test_eval_with_the_int8_lm_head_on_the_cpu_reference(capsys, monkeypatch, model_dir, text_file):
    """--lm-head-int8 rounds the CPU reference's head as the engine stores it: the logits move a little (KL above
    zero, far below the int8 linears' own) and the greedy choice almost never."""
    code, out, err = fllama(capsys, monkeypatch, "eval", model_dir, "--data", text_file, "--seq-len", "64",
                            "--max-tokens", "512", "--device", "cpu", "--json", "--baseline", model_dir,
                            "--lm-head-int8")
    r = json.loads(out)
    assert code == 0, err
    assert 0 < r["kl_divergence"] < 1e-3 and r["top1_agreement"] > 0.97
    assert r["perplexity"] == pytest.approx(r["baseline_perplexity"], rel=1e-2)


def test_calibrate_then_quantize_every_scheme(capsys, monkeypatch, model_dir, text_file, tmp_path):
    stats = tmp_path / "stats.safetensors"
    code, out, err = fllama(capsys, monkeypatch, "calibrate", model_dir, "--data", text_file, "--samples", "4",
                            "--seq-len", "32", "-o", stats, "--device", "cpu", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert set(table["layers.0.qkv"]) == {"max", "percentile", "mse", "entropy"}
    assert table["layers.1.down"]["max"]["amax"] >= table["layers.1.down"]["percentile"]["amax"]
    code, out, err = fllama(capsys, monkeypatch, "calibrate", "--from-stats", stats, "--method", "entropy", "--json")
    assert code == 0 and set(json.loads(out)["layers.0.o"]) == {"entropy"}
    runs = {"int8": ["--scheme", "int8"],
            "static": ["--scheme", "int8", "--act", "static", "--calibrator", "mse", "--stats", stats],
            "smooth": ["--scheme", "int8", "--act", "static", "--smooth", "0.5", "--stats", stats, "--data", text_file],
            "awq": ["--scheme", "awq", "--group-size", "32", "--data", text_file, "--samples", "4", "--seq-len", "32"],
            "rtn": ["--scheme", "awq", "--group-size", "32", "--method", "rtn"]}
    for name, extra in runs.items():
        out_dir = tmp_path / name
        code, out, err = fllama(capsys, monkeypatch, "quantize", model_dir, "-o", out_dir, "--device", "cpu", "--json", *extra)
        assert code == 0, (name, err)
        assert (out_dir / "model.safetensors").exists() and (out_dir / "fllama_meta.json").exists()
        info = json.loads(fllama(capsys, monkeypatch, "info", out_dir, "--json")[1])
        assert info["scheme"] == ("awq" if name in ("awq", "rtn") else "int8")
        code, out, err = fllama(capsys, monkeypatch, "generate", out_dir, "-p", "It was", "-n", "3", "--temperature", "0",
                                "--device", "cpu", "--json")
        assert code == 0, (name, err)
    # an existing output is kept unless --force
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "-o", tmp_path / "int8", "--scheme", "int8")
    assert_one_line_error(code, err, "--force")


ERRORS = [
    (["generate", "/no/such/model", "-p", "x"], "no such file"),
    (["generate", "{model}", "-p", "   ", "--device", "cpu"], "empty"),
    (["generate", "{model}", "-p", "word " * 400, "--device", "cpu"], "context"),
    (["generate", "{model}", "-p", "x", "--temperature", "-1", "--device", "cpu"], "temperature"),
    (["eval", "{model}", "--data", "gutenberg:nope", "--device", "cpu"], "unknown book"),
    (["eval", "{model}", "--data", "unknown-corpus", "--device", "cpu"], "text source"),
    (["calibrate", "{model}", "--method", "kl", "-o", "{tmp}/s.safetensors"], "unknown calibration method"),
    (["calibrate", "{model}", "--percentile", "0", "-o", "{tmp}/s.safetensors"], "percentile"),
    (["calibrate", "{model}", "--bins", "64", "-o", "{tmp}/s.safetensors"], "bins"),
    (["calibrate", "{model}", "--seq-len", "1000", "-o", "{tmp}/s.safetensors", "--device", "cpu"], "context"),
    (["calibrate", "{model}", "--data", "{tiny_text}", "--samples", "50", "--seq-len", "64", "-o", "{tmp}/s.safetensors",
      "--device", "cpu"], "tokens"),
    (["quantize", "{model}", "--scheme", "awq", "--group-size", "48", "-o", "{tmp}/q", "--method", "rtn"], "32"),
    (["quantize", "{model}", "--scheme", "int8", "--act", "static", "-o", "{tmp}/q"], "stats"),
    (["quantize", "{model}", "--scheme", "int8", "--act", "static", "--stats", "{tmp}/missing.safetensors", "-o", "{tmp}/q"],
     "not found"),
    (["bench", "--random", "--model", "llama2-7b"], "GPU"),
    (["generate", "llama2-7b", "-p", "x"], "--random"),
    (["generate", "{model}", "-p", "x", "--device", "cuda"], "cuda"),
    (["generate", "{model}", "-p", "x", "--device", "cpu", "--kv-int8"], "GPU engine"),
]


@pytest.mark.parametrize("args,needle", ERRORS, ids=[" ".join(a[:2]) + f" {i}" for i, (a, _) in enumerate(ERRORS)])
def test_user_errors_are_one_line(capsys, monkeypatch, model_dir, tmp_path, args, needle):
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("only a few words here")
    subs = {"{model}": str(model_dir), "{tmp}": str(tmp_path), "{tiny_text}": str(tiny_text)}
    full = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        full.append(a)
    code, _, err = fllama(capsys, monkeypatch, *full)
    assert_one_line_error(code, err, needle)


def test_corrupt_and_foreign_checkpoints(capsys, monkeypatch, model_dir, tmp_path):
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(model_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_one_line_error(*fllama(capsys, monkeypatch, "generate", bad, "-p", "x", "--device", "cpu")[::2], "")
    foreign = tmp_path / "falcon"
    shutil.copytree(model_dir, foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (foreign / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*fllama(capsys, monkeypatch, "info", foreign)[::2], "falcon")
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    assert_one_line_error(*fllama(capsys, monkeypatch, "info", gguf)[::2], "")


def test_stats_from_another_model_are_refused(capsys, monkeypatch, model_dir, text_file, tmp_path):
    other = tmp_path / "other"
    write_hf_dir(other, LlamaConfig(hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                                    max_positions=256, name="other"))
    stats = tmp_path / "other.safetensors"
    code, _, err = fllama(capsys, monkeypatch, "calibrate", other, "--data", text_file, "--samples", "2", "--seq-len", "32",
                          "-o", stats, "--device", "cpu", "-q")
    assert code == 0, err
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "int8", "--act", "static", "--stats",
                          stats, "-o", tmp_path / "q")
    assert_one_line_error(code, err, "another model")


def test_debug_variable_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("FLLAMA_DEBUG", "1")
    with pytest.raises(Exception):
        fllama(capsys, monkeypatch, "generate", "/no/such/model", "-p", "x")
