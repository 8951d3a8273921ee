"""fllama bench's arithmetic on CPU: the bytes a decode step reads (the floor) and the table's header."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fllama_cli.bench import _markdown
from kernels_cu.bench import BenchConfig, decode_bytes
from kernels_cu.engine import Engine, EngineConfig, KvKind
from model_zoo.config import LlamaConfig
from model_zoo.sampling import SamplingConfig


def fake_engine(kv: KvKind) -> SimpleNamespace:
    c = LlamaConfig.from_name("llama2-7b")
    e = SimpleNamespace(config=c, cfg=EngineConfig(kv=kv), embed=torch.empty(0), lm_head=None)
    e.kv_position_bytes = lambda: Engine.kv_position_bytes(e)
    e.step_weight_bytes = lambda batch: 1000 + 4096 * 2 * batch
    return e


def test_decode_bytes_count_the_kv_cache_as_stored():
    """fp16: K and V of 32 layers x 32 heads x 128 dims at 2 bytes; int8 and fp8: 1-byte codes + a 4-byte scale
    per head and position, so the floor of a --kv-int8 / --kv-fp8 run counts what its kernels read."""
    w16, kv16 = decode_bytes(fake_engine(KvKind.FP16), batch=2, context=576)
    w8, kv8 = decode_bytes(fake_engine(KvKind.INT8), batch=2, context=576)
    wf8, kvf8 = decode_bytes(fake_engine(KvKind.FP8), batch=2, context=576)
    assert kv16 == 2 * 32 * 2 * 576 * 32 * 128 * 2
    assert kv8 == kvf8 == 2 * 32 * 2 * 576 * 32 * (128 + 4)
    assert w16 == w8 == wf8 == 1000 + 4096 * 2 * 2  # the engine's count for two rows
    e = fake_engine(KvKind.FP8)
    assert Engine.kv_bytes(e, 3, 99) == 3 * 100 * e.kv_position_bytes()  # the cache: max_len + 1 positions


def test_markdown_header_says_which_kv_cache_ran():
    meta = {"model": "llama2-7b", "gpu": "GPU", "driver": "1", "date": "2026-11-22", "copy_bandwidth_tb_s": 3.0,
            "prompt_len": 512, "gen_len": 128, "repeat": 3, "programmatic_launch": True, "baseline": {},
            "kv_cache": "int8"}
    row = {"scheme": "int8", "batch": 1, "decode_tok_s": 400.0}
    assert "KV cache int8" in _markdown([row], meta)
    assert "KV cache fp8" in _markdown([row], {**meta, "kv_cache": "fp8"})
    assert "KV cache" not in _markdown([row], {**meta, "kv_cache": "fp16"})


def test_markdown_header_says_when_the_lm_head_is_int8():
    meta = {"model": "llama2-7b", "gpu": "GPU", "driver": "1", "date": "2026-11-22", "copy_bandwidth_tb_s": 3.0,
            "prompt_len": 512, "gen_len": 128, "repeat": 3, "programmatic_launch": True, "baseline": {},
            "kv_cache": "fp16", "lm_head_int8": True}
    row = {"scheme": "awq", "batch": 1, "decode_tok_s": 600.0}
    assert "lm_head int8" in _markdown([row], meta)
    assert "lm_head int8" not in _markdown([row], {**meta, "lm_head_int8": False})


def test_sampled_bench_says_how_it_sampled():
    """--temperature samples the engine's steps and loop; the header says so, and that the baseline stays greedy."""
    from kernels_cu.bench_suite import _sampling_note
    from model_zoo.sampling import SamplingConfig

    assert BenchConfig().sampling == SamplingConfig(temperature=0)
    assert _sampling_note(SamplingConfig(temperature=0)) == "greedy"
    note = _sampling_note(SamplingConfig(temperature=0.7))
    assert note == "temperature 0.7, top-k 40, top-p 0.95"
    meta = {"model": "llama3-8b", "gpu": "GPU", "driver": "1", "date": "2026-11-28", "copy_bandwidth_tb_s": 4.2,
            "prompt_len": 512, "gen_len": 64, "repeat": 2, "programmatic_launch": True, "baseline": {},
            "kv_cache": "fp16", "sampling": note}
    row = {"scheme": "awq", "batch": 1, "decode_tok_s": 600.0}
    assert "sampling temperature 0.7, top-k 40, top-p 0.95 (the baseline greedy)" in _markdown([row], meta)
    assert "sampling" not in _markdown([row], {**meta, "sampling": "greedy"})


@pytest.mark.parametrize("args,want", [
    ([], SamplingConfig(temperature=0)),
    (["--temperature", "0.7"], SamplingConfig(temperature=0.7, top_k=40, top_p=0.95)),
    (["--temperature", "1", "--top-k", "0", "--top-p", "0.9"], SamplingConfig(temperature=1.0, top_k=0, top_p=0.9)),
])
def test_bench_cli_passes_the_sampling_options(args, want, monkeypatch, capsys):
    """`fllama bench --temperature / --top-k / --top-p` reach the bench's config (run_bench stubbed: no GPU)."""
    import sys

    from fllama_cli.main import main
    from kernels_cu import bench_suite

    seen = []
    monkeypatch.setattr(bench_suite, "run_bench", lambda req, progress: seen.append(req) or ([], META))
    monkeypatch.setattr(sys, "argv", ["fllama", "bench", "--random", "--model", "llama3-8b", "--json", *args])
    try:
        main()
    except SystemExit as e:  # typer may exit 0 after a command
        assert e.code in (0, None), capsys.readouterr().err
    assert len(seen) == 1 and seen[0].cfg.sampling == dataclasses.replace(want, seed=None)


def test_bench_cli_refuses_bad_sampling_in_one_line(monkeypatch, capsys):
    import sys

    from fllama_cli.main import main

    monkeypatch.setattr(sys, "argv", ["fllama", "bench", "--random", "--temperature", "-1"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and "temperature" in err and "Traceback" not in err, err


META = {"model": "llama3-8b", "gpu": "GPU", "driver": "1", "date": "2026-11-28", "copy_bandwidth_tb_s": 4.2,
        "prompt_len": 512, "gen_len": 128, "repeat": 3, "programmatic_launch": True, "baseline": {},
        "kv_cache": "fp16", "sampling": "greedy"}
