"""CalibStats: save/load round trip, atomic writes, refusal to overwrite, bad files, model identity."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import calibrate.stats as stats_mod
from calibrate.collectors import ChannelStatsCollector, HistogramCollector
from calibrate.methods import CalibConfig
from calibrate.ranges import compute_amax
from calibrate.stats import POINT_KINDS, CalibStats, PointStats, make_meta, point_name
from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, FllamaError

CONFIG = LlamaConfig.from_name("smollm2-135m").replace(n_layers=2)


def _stats(config=CONFIG, bins=256) -> CalibStats:
    g = torch.Generator().manual_seed(0)
    points = {}
    for layer in range(config.n_layers):
        for kind in POINT_KINDS:
            channels = config.ffn_size if kind == "down" else config.hidden_size
            h, c = HistogramCollector(bins=bins), ChannelStatsCollector()
            for _ in range(2):
                x = torch.randn(16, channels, generator=g) * (1 + layer)  # [T, C]
                x[0, 3] = 40.0  # an outlier channel
                h.collect(x)
                c.collect(x)
            points[point_name(layer, kind)] = PointStats.from_collectors(h, c)
    calib = CalibConfig(bins=bins, percentile=99.9)
    meta = make_meta(config, calib, source="gutenberg:history", samples=2, seq_len=16, tokens=32)
    return CalibStats(points=points, meta=meta)


def test_round_trip_keeps_every_tensor_and_the_metadata(tmp_path):
    s = _stats()
    path = s.save(tmp_path / "stats.safetensors")
    back = CalibStats.load(path)
    assert list(back.points) == list(s.points)
    for name, p in s.points.items():
        q = back.points[name]
        assert torch.equal(p.hist, q.hist) and torch.equal(p.edges, q.edges)
        assert torch.equal(p.max_abs, q.max_abs) and torch.equal(p.mean_abs, q.mean_abs)
        assert q.amax == p.amax == 40.0
    assert back.meta == s.meta
    assert back.calib_config == CalibConfig(bins=256, percentile=99.9)
    assert back.ranges() == s.ranges()


def test_metadata_is_one_json_string_under_the_fllama_key(tmp_path):
    path = _stats().save(tmp_path / "s.safetensors")
    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata()
        keys = set(f.keys())
    assert set(raw) == {"fllama"}
    meta = json.loads(raw["fllama"])
    assert meta["format"] == "fllama.calib_stats" and meta["version"] == 1
    assert meta["model"]["name"] == "smollm2-135m" and meta["model"]["n_layers"] == 2
    assert meta["model"]["hidden_size"] == 576 and len(meta["model"]["config_hash"]) == 16
    assert meta["source"] == "gutenberg:history" and meta["samples"] == 2 and meta["seq_len"] == 16
    assert meta["bins"] == 256 and meta["calib"]["percentile"] == 99.9 and meta["calib"]["method"] == "all"
    assert "fllama_version" in meta
    assert "layers.1.down.max_abs" in keys and "layers.0.qkv.hist" in keys


def test_ranges_per_point_and_method():
    s = _stats()
    r = s.ranges()
    assert list(r) == [f"layers.{i}.{k}" for i in range(2) for k in POINT_KINDS]
    p = s.points["layers.1.o"]
    assert set(r["layers.1.o"]) == {"max", "percentile", "mse", "entropy"}
    assert r["layers.1.o"]["max"] == p.amax  # the exact max, not a bin edge
    assert r["layers.1.o"]["mse"] == compute_amax("mse", p.hist, p.edges, s.calib_config)
    only = s.ranges(CalibConfig(method="percentile", percentile=50.0, bins=256))
    assert set(only["layers.0.qkv"]) == {"percentile"}
    assert only["layers.0.qkv"]["percentile"] < r["layers.0.qkv"]["percentile"]


def test_refuses_to_overwrite_unless_forced(tmp_path):
    path = tmp_path / "stats.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(FllamaError, match="already exists.*--force"):
        _stats().save(path)
    assert path.read_bytes() == b"precious"
    _stats().save(path, force=True)
    assert CalibStats.load(path).meta["samples"] == 2
    with pytest.raises(FllamaError, match="directory"):
        _stats().save(tmp_path, force=True)


def test_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "stats.safetensors"
    path.write_bytes(b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(stats_mod.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        _stats().save(path, force=True)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["stats.safetensors"]


def test_save_creates_parent_directories_and_leaves_no_temp(tmp_path):
    path = _stats().save(tmp_path / "a" / "b" / "stats.safetensors")
    assert os.listdir(path.parent) == ["stats.safetensors"]


def test_unreadable_and_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(FllamaError, match="not found"):
        CalibStats.load(tmp_path / "missing.safetensors")
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a safetensors file")
    with pytest.raises(CorruptCheckpointError, match="not a readable safetensors"):
        CalibStats.load(text)
    bare = tmp_path / "bare.safetensors"
    save_file({"w": torch.zeros(2)}, str(bare))
    with pytest.raises(CorruptCheckpointError, match="no fllama metadata"):
        CalibStats.load(bare)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"fllama": json.dumps({"format": "fllama.checkpoint"})})
    with pytest.raises(CorruptCheckpointError, match="not a calibration stats file"):
        CalibStats.load(other)
    broken = tmp_path / "broken.safetensors"
    save_file({"layers.0.qkv.hist": torch.zeros(4, dtype=torch.float64)}, str(broken),
              metadata={"fllama": json.dumps({"format": "fllama.calib_stats", "version": 1})})
    with pytest.raises(CorruptCheckpointError, match="lacks edges"):
        CalibStats.load(broken)


def test_truncated_file_is_corrupt(tmp_path):
    path = _stats().save(tmp_path / "s.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError):
        CalibStats.load(path)


def test_check_model_accepts_the_same_model_and_names_the_other():
    s = _stats()
    s.check_model(CONFIG)
    with pytest.raises(FllamaError, match="another model.*smollm2-135m.*llama2-7b"):
        s.check_model(LlamaConfig.from_name("llama2-7b"))
    renamed = CONFIG.replace(name="my-finetune")
    with pytest.raises(FllamaError, match="another model"):
        s.check_model(renamed)
    s.check_model(renamed, check_name=False)  # same shape, the caller vouches for the weights
    with pytest.raises(FllamaError, match="another model"):
        s.check_model(CONFIG.replace(n_layers=3), check_name=False)


def test_points_load_in_layer_order(tmp_path):
    config = CONFIG.replace(n_layers=11)
    s = _stats(config, bins=128)
    s.points = dict(reversed(list(s.points.items())))  # written in the wrong order
    back = CalibStats.load(s.save(tmp_path / "s.safetensors"))
    names = list(back.points)
    assert names[:5] == ["layers.0.qkv", "layers.0.o", "layers.0.gate_up", "layers.0.down", "layers.1.qkv"]
    assert names.index("layers.2.down") < names.index("layers.10.qkv")


def test_rope_scaling_is_part_of_the_model_identity():
    import dataclasses

    from calibrate.stats import config_hash
    from model_zoo.config import LlamaConfig

    scaled = LlamaConfig.from_name("llama3.1-8b")
    assert scaled.rope_scaling is not None
    plain = dataclasses.replace(scaled, rope_scaling=None)
    other = dataclasses.replace(scaled, rope_scaling=dataclasses.replace(scaled.rope_scaling, factor=16.0))
    assert len({config_hash(scaled), config_hash(plain), config_hash(other)}) == 3
