"""A new user's mistakes (issue 40): each is refused in one line before any long work, or handled without losing
the session, the output or the meaning of a number."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from calibrate.outputs import OutputKind, clean_stale, prepare_output, temp_prefix
from calibrate.quantize import QuantConfig
from fllama_cli.prompts import as_text
from model_zoo.chat import ChatSession
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, FllamaError, PromptError
from model_zoo.evaluation import EvalConfig, evaluate
from model_zoo.generation import GenerationConfig, generate
from model_zoo.quant.formats import Scheme
from model_zoo.quant.int8 import ActQuant
from model_zoo.sampling import SamplingConfig
from tests._fixtures_loaders import trained_sentencepiece, write_hf_dir
from tests.helpers import byte_tokenizer, tiny_model
from tests.test_cli import assert_one_line_error, fllama

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  rope_theta=50000.0, max_positions=256, name="bad-input-tiny")
CPU = ("--device", "cpu")


def run_json(capsys, monkeypatch, *args):
    code, out, err = fllama(capsys, monkeypatch, *args)
    assert code == 0, err
    return json.loads(out)


# --- eval -----------------------------------------------------------------------------------------------
def test_eval_random_leaves_the_baseline_as_it_is(capsys, monkeypatch, model_dir, text_file):
    args = ("eval", model_dir, "--data", text_file, "--seq-len", "64", "--max-tokens", "256", *CPU, "--json")
    plain = run_json(capsys, monkeypatch, *args)
    both = run_json(capsys, monkeypatch, *args, "--random", "--baseline", model_dir)
    assert both["baseline_perplexity"] == pytest.approx(plain["perplexity"], rel=1e-6)
    assert both["perplexity"] != pytest.approx(plain["perplexity"], rel=1e-3) and both["kl_divergence"] > 0


def test_eval_seq_len_is_checked_against_the_context(capsys, monkeypatch, model_dir, text_file):
    code, _, err = fllama(capsys, monkeypatch, "eval", model_dir, "--data", text_file, "--seq-len", "1000",
                          "--max-tokens", "2000", *CPU)
    assert_one_line_error(code, err, "beyond the model's context of 256")
    default = run_json(capsys, monkeypatch, "eval", model_dir, "--data", text_file, "--max-tokens", "512", *CPU, "--json")
    assert default["seq_len"] == 256  # the default 512 does not fit this model: its context is taken


def test_eval_baseline_with_another_tokenizer_is_refused(capsys, monkeypatch, model_dir, text_file, tmp_path):
    other = tmp_path / "other"
    write_hf_dir(other, CFG, tokenizer=False)
    byte_tokenizer(CFG.vocab_size).save(other)  # same vocabulary size, other tokens: bytes
    code, _, err = fllama(capsys, monkeypatch, "eval", model_dir, "--data", text_file, "--seq-len", "64",
                          "--max-tokens", "128", "--baseline", other, *CPU)
    assert_one_line_error(code, err, "tokenizer")


# --- token ids ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 300, 10**6])
def test_token_ids_outside_the_vocabulary_are_errors_everywhere(bad):
    model, tok = tiny_model(), byte_tokenizer()
    with pytest.raises(PromptError, match=f"token id {bad}"):
        generate(model, tok, [[5, bad]], GenerationConfig(max_new_tokens=2))
    with pytest.raises(PromptError, match=f"token id {bad}"):
        evaluate(model, torch.tensor([[5, 6, bad, 7]]), EvalConfig(seq_len=4, max_tokens=4))
    with pytest.raises(PromptError, match=f"token id {bad}"):
        model.forward(torch.tensor([[bad]]))


def test_a_tokenizer_larger_than_the_model_is_one_line(capsys, monkeypatch, tmp_path):
    d = tmp_path / "small-vocab"
    write_hf_dir(d, CFG.replace(vocab_size=300), tokenizer=False)
    (d / "tokenizer.model").write_bytes(trained_sentencepiece(512))  # ids up to 511 for a 300-row embedding
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    code, _, err = fllama(capsys, monkeypatch, "generate", d, "-p", "Holmes said that the gentleman was there", *CPU)
    assert_one_line_error(code, err, "outside the model's vocabulary of 300")


# --- outputs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["quantize", "calibrate"])
def test_an_unwritable_output_is_found_before_the_work(capsys, monkeypatch, tmp_path, cmd):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    # the model does not exist: the output is checked before anything is loaded
    code, _, err = fllama(capsys, monkeypatch, cmd, "/no/such/model", "-o", blocker / "out", *CPU)
    assert_one_line_error(code, err, "not a directory")


def test_a_read_only_directory_is_found_by_a_probe(tmp_path, monkeypatch):
    import tempfile

    def refuse(*_a, **_k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(FllamaError, match="cannot write in .*Read-only"):
        prepare_output(tmp_path / "ck", OutputKind.CHECKPOINT)


def test_too_little_free_space_is_found_before_the_work(capsys, monkeypatch, model_dir, tmp_path):
    import shutil
    from types import SimpleNamespace

    import calibrate.pipeline
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: SimpleNamespace(total=10**9, used=10**9 - 4096, free=4096))
    monkeypatch.setattr(calibrate.pipeline, "quantize_int8", lambda *a, **k: pytest.fail("quantized anyway"))
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "-o", tmp_path / "ck", *CPU)
    assert_one_line_error(code, err, "MiB free")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("make", ["file", "foreign-dir"])
def test_force_replaces_only_a_checkpoint(capsys, monkeypatch, model_dir, tmp_path, make):
    target = tmp_path / "target"
    if make == "file":
        target.write_text("a user's file")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("a user's notes")
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "-o", target, "--force", *CPU)
    assert_one_line_error(code, err, "--force replaces only a checkpoint")
    assert (target.read_text() if make == "file" else (target / "notes.txt").read_text()).startswith("a user's")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_killed_mid_write_is_cleaned_up_by_the_next(capsys, monkeypatch, model_dir, tmp_path):
    out = tmp_path / "ck"
    # a real kill -9 of a process that was writing the checkpoint's temporary directory
    script = ("import os, signal, tempfile, pathlib; from calibrate.outputs import temp_prefix; "
              f"out = pathlib.Path({str(out)!r}); "
              "d = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out), suffix='.tmp')); "
              "(d / 'model.safetensors').write_bytes(b'x' * 4096); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], check=False)
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].name.startswith(".ck.fllama-")
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "-o", out, *CPU)
    assert code == 0, err
    assert "removed" in err and not left[0].exists() and (out / "config.json").is_file()


def test_stale_temporaries_of_live_runs_are_kept_and_a_moved_aside_checkpoint_is_restored(tmp_path):
    live = tmp_path / (temp_prefix(tmp_path / "a") + "live.tmp")  # this process: running
    live.mkdir()
    aside = tmp_path / (temp_prefix(tmp_path / "b", pid=_dead_pid()) + "old.tmp")  # an interrupted --force
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    legacy = tmp_path / ".c.ab12cd34.tmp"
    legacy.mkdir()
    (legacy / "fllama_meta.json").write_text("{}")
    notes = clean_stale(tmp_path)
    assert live.exists() and legacy.exists()
    assert (tmp_path / "b" / "config.json").is_file() and not aside.exists()
    assert any("restored" in n for n in notes) and any(str(legacy) in n for n in notes)


def test_checkpoint_files_have_the_ordinary_mode(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "fp16", "-o", tmp_path / "ck", *CPU)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    for f in [tmp_path / "ck", *(tmp_path / "ck").iterdir()]:
        assert f.stat().st_mode & 0o777 == (0o777 if f.is_dir() else 0o666) & ~umask, f


# --- quantize defaults and options that do not apply ----------------------------------------------------
def test_awq_group_size_defaults_to_the_largest_that_fits():
    smol = LlamaConfig.from_name("smollm2-135m")  # hidden 576: 128 does not divide it
    cfg, note = QuantConfig(scheme=Scheme.AWQ).with_group_size(smol)
    assert cfg.group_size == 64 and "64" in note
    assert QuantConfig(scheme=Scheme.AWQ).with_group_size(CFG)[0].group_size == 32  # ffn 96
    assert QuantConfig(scheme=Scheme.AWQ, group_size=32).with_group_size(smol) == (
        QuantConfig(scheme=Scheme.AWQ, group_size=32), None)
    with pytest.raises(ConfigError, match="give --group-size"):
        QuantConfig(scheme=Scheme.AWQ).with_group_size(CFG.replace(hidden_size=48, n_heads=3, n_kv_heads=3))


def test_awq_with_every_default_runs_and_says_which_group(capsys, monkeypatch, model_dir, tmp_path):
    code, out, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "awq", "--method", "rtn",
                            "-o", tmp_path / "awq", *CPU, "--json")
    assert code == 0, err
    assert json.loads(out)["group_size"] == 32 and "AWQ group size 32" in err


def test_static_activations_default_to_mse_ranges():
    assert QuantConfig(scheme=Scheme.INT8, act=ActQuant.STATIC).calibrator.value == "mse"  # docs/quality.md


NOT_APPLYING = [
    (["quantize", "--scheme", "int8", "--group-size", "64"], "--group-size applies to --scheme awq"),
    (["quantize", "--scheme", "fp16", "--method", "rtn"], "--method applies to --scheme awq"),
    (["quantize", "--scheme", "int8", "--calibrator", "mse"], "--calibrator"),
    (["quantize", "--scheme", "int8", "--act", "static", "--stats", "{tmp}/s.st", "--percentile", "99"], "--percentile"),
    (["quantize", "--scheme", "awq", "--stats", "{tmp}/s.st"], "--stats"),
    (["quantize", "--scheme", "int8", "--samples", "4"], "--samples"),
    (["calibrate", "--method", "mse", "--percentile", "99"], "--percentile"),
    (["calibrate", "--from-stats", "{tmp}/s.st", "--samples", "4"], "--from-stats"),
    (["chat", "--context", "0"], "--context 0"),
    (["chat", "--context", "100000"], "beyond the model's context of 256"),
    (["generate", "-p", "x", "--temperature", "nan"], "temperature"),
    (["generate", "-p", "x", "--stop", ""], "stop string is empty"),
    (["calibrate", "--samples", "0"], "samples must be >= 1"),
]


@pytest.mark.parametrize("args,needle", NOT_APPLYING, ids=[" ".join(a[:3]) for a, _ in NOT_APPLYING])
def test_options_that_do_not_apply_are_refused(capsys, monkeypatch, model_dir, tmp_path, args, needle):
    cmd, *rest = [a.replace("{tmp}", str(tmp_path)) for a in args]
    model = [] if "--from-stats" in rest else [model_dir]
    out = ["-o", tmp_path / "out"] if cmd in ("quantize", "calibrate") and "--from-stats" not in rest else []
    code, _, err = fllama(capsys, monkeypatch, cmd, *model, *rest, *out, *CPU, stdin="")
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_bench_refuses_what_it_would_ignore_or_overwrite_before_running(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "bench", model_dir, "--scheme", "fp16", "--group-size", "64")
    assert_one_line_error(code, err, "--group-size sets the AWQ groups of --random weights")
    report = tmp_path / "report.md"
    report.write_text("last week's numbers")
    code, _, err = fllama(capsys, monkeypatch, "bench", "--random", "--markdown", report)
    assert_one_line_error(code, err, "--force")
    code, _, err = fllama(capsys, monkeypatch, "bench", "--random", "--markdown", report / "x.md")
    assert_one_line_error(code, err, "not a directory")


def test_a_seed_out_of_range_and_a_huge_allocation_are_one_line(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "x", "--seed", str(2**80), *CPU)
    assert code == 2 and err.startswith("error:") and "--seed" in err and len(err.strip().splitlines()) == 1
    from fllama_cli.errors import describe
    assert describe(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8e10 bytes")) \
        .startswith("out of host memory")


def test_text_sources_a_directory_and_any_text_file(tmp_path):
    from model_zoo.errors import TextSourceError
    from model_zoo.text_sources import load_text
    (tmp_path / "notes.md").write_text("# notes\nplain text")
    assert load_text(str(tmp_path / "notes.md")).startswith("# notes")
    with pytest.raises(TextSourceError, match="is a directory"):
        load_text(str(tmp_path))


def test_sampling_options_greedy_ignores_are_named(capsys, monkeypatch, model_dir):
    code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "x", "-n", "2", "--temperature", "0",
                          "--top-p", "0.5", *CPU, "--json")
    assert code == 0 and "--top-p does nothing with --temperature 0" in err


# --- chat -----------------------------------------------------------------------------------------------
def _session(max_len=96, n=8, system="be brief"):
    cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(temperature=0))
    return ChatSession(tiny_model(), byte_tokenizer(), cfg, system=system, max_len=max_len)


def test_a_conversation_longer_than_the_context_drops_its_oldest_turns():
    chat = _session(max_len=120, n=4)  # about two exchanges of the byte-level template
    replies = []
    for i in range(4):
        replies.append(chat.send(f"message {i}"))
        assert int(chat.cache.lengths[0]) == len(chat.cached_ids) <= chat.max_len
    assert [r.dropped_turns for r in replies] == [0, 0, 1, 1]
    assert chat.messages[0] == {"role": "system", "content": "be brief"}  # the system prompt stays
    assert [m["content"] for m in chat.messages[1::2]] == ["message 2", "message 3"]


def test_a_message_too_long_for_the_context_keeps_the_session():
    chat = _session()
    chat.send("hello")
    before = list(chat.messages)
    with pytest.raises(PromptError, match="shorten it"):
        chat.send("word " * 200)
    assert chat.messages == before
    assert chat.send("and again").text is not None


def test_ctrl_c_stops_the_reply_not_the_session():
    chat = _session(max_len=120, n=6)

    def interrupt(_row, _text):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        chat.send("tell me a story", on_text=interrupt)
    assert chat.messages[-1]["role"] == "assistant" and int(chat.cache.lengths[0]) == len(chat.cached_ids)
    reply = chat.send("go on")
    assert reply.stats.generated_tokens > 0 and chat.messages[-2]["content"] == "go on"
    # what the cache holds is what a fresh prefill of the same tokens computes
    cached = chat.backend.forward(torch.tensor([[42]]), chat.cache, torch.tensor([0]))[0, -1]
    fresh = chat.backend.forward(torch.tensor([chat.cached_ids + [42]]))[0, -1]
    torch.testing.assert_close(cached, fresh, rtol=1e-4, atol=1e-4)


def test_chat_keeps_going_over_stdin_when_the_context_is_outgrown(capsys, monkeypatch, model_dir):
    lines = "".join(f"this is message {i} of a long chat\n" for i in range(6))
    code, _, err = fllama(capsys, monkeypatch, "chat", model_dir, "--context", "60", "-n", "8", "--temperature", "0",
                          *CPU, stdin=lines)
    assert code == 0, err
    assert "dropped" in err and "error" not in err


def test_chat_ctrl_c_in_a_terminal_stops_only_the_reply(capsys, monkeypatch, model_dir):
    import fllama_cli.chat as chat_cli
    from rich.console import Console

    inputs = iter(["first", "second", "/exit"])
    monkeypatch.setattr(Console, "input", lambda self, *_a, **_k: next(inputs))
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    real_send, calls = chat_cli.ChatSession.send, []

    def send(self, text, on_text=None):
        calls.append(text)
        if len(calls) == 1:  # Ctrl-C during the first reply
            raise KeyboardInterrupt
        return real_send(self, text, on_text)
    monkeypatch.setattr(chat_cli.ChatSession, "send", send)
    code, out, err = fllama(capsys, monkeypatch, "chat", model_dir, "-n", "3", "--temperature", "0", *CPU)
    assert code == 0, err
    assert calls == ["first", "second"] and "(reply stopped)" in out


# --- prompts and text -----------------------------------------------------------------------------------
def test_a_too_long_prompt_is_not_echoed(capsys, monkeypatch, model_dir):
    prompt = "word " * 400
    code, out, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", prompt, *CPU)
    assert_one_line_error(code, err, "context")
    assert "word word" not in out + err


def test_brackets_in_prompts_and_paths_are_text_not_markup(capsys, monkeypatch, model_dir, tmp_path):
    code, out, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "a [/] b [bold]c", "-n", "2", *CPU)
    assert code == 0 and out.startswith("a [/] b [bold]c"), err
    code, out, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "[/]", "-p", "[red]x", "-n", "2", *CPU)
    assert code == 0 and "[/]" in out and "[red]x" in out, err
    code, _, err = fllama(capsys, monkeypatch, "eval", model_dir, "--data", tmp_path / "[bold]missing.txt", *CPU)
    assert_one_line_error(code, err, "[bold]missing.txt")


def test_text_that_is_not_utf8_is_one_line(capsys, monkeypatch, model_dir):
    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"caf\xe9 au lait")  # Latin-1, not UTF-8

    monkeypatch.setattr(sys, "stdin", Stdin())
    code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-n", "2", *CPU)
    assert_one_line_error(code, err, "standard input is not UTF-8 text (byte 0xe9 at position 3)")
    code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "caf\udce9", "-n", "2", *CPU)  # argv
    assert_one_line_error(code, err, "not UTF-8")
    assert as_text("café", "x") == "café"


def test_wikitext2_offline_fails_at_once(monkeypatch):
    import huggingface_hub.constants as hub_constants

    from model_zoo import text_sources
    from model_zoo.errors import TextSourceError
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(TextSourceError, match="HF_HUB_OFFLINE"):
        text_sources._hub_file("no-org/no-dataset", "nothing.parquet")
    assert time.perf_counter() - t0 < 5
    assert "unreachable" in text_sources._unreachable("http://127.0.0.1:9", timeout=1.0)


# --- the command line itself ----------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["generate", "chat", "eval", "info", "calibrate", "quantize", "bench"])
def test_help_has_examples_and_flags_read_as_flags(capsys, monkeypatch, cmd):
    monkeypatch.setenv("COLUMNS", "160")
    code, out, _ = fllama(capsys, monkeypatch, cmd, "--help")
    assert code == 0 and "Examples" in out and f"fllama {cmd}" in out.split("Examples", 1)[1]
    assert "<bool>" not in out and "list[str]" not in out
    if cmd == "quantize":
        assert "required" in out


def test_a_command_line_the_parser_rejects_is_one_line(capsys, monkeypatch):
    code, _, err = fllama(capsys, monkeypatch, "eval", "--seq-len", "many")
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:") and "--seq-len" in err
    code, _, err = fllama(capsys, monkeypatch, "quantize")
    assert code == 2 and "Missing option '--output'" in err and len(err.strip().splitlines()) == 1


def test_samples_zero_is_not_taken_for_not_given(tmp_path):
    from calibrate.pipeline import _given

    assert _given(0, 128) == 0 and _given(None, 128) == 128
