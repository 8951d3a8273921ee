"""calibrate.pipeline without the CLI: what run_calibrate / run_quantize write, return and report as progress."""

from __future__ import annotations

import json

import pytest

from calibrate.calibration import DataConfig
from calibrate.methods import CalibConfig, CalibMethod
from calibrate.pipeline import RECAPTURE, CalibrateJob, QuantizeJob, run_calibrate, run_quantize
from calibrate.quantize import QuantConfig
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant.formats import Scheme
from model_zoo.quant.int8 import ActQuant

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=256, name="pipeline-tiny")


def test_calibrate_then_smoothed_static_int8(model_dir, text_file, tmp_path):
    data = DataConfig(source=str(text_file), samples=2, seq_len=32)
    events = []
    job = CalibrateJob(model=str(model_dir), output=tmp_path / "s.safetensors", data=data,
                       calib=CalibConfig(method=CalibMethod.MAX), device="cpu")
    stats = run_calibrate(job, lambda *e: events.append(e))
    assert job.output.exists() and stats.meta["device"] == "cpu"
    assert events[0] == (0, 2, 0)  # the start, then tokens of layer 0 and 1
    assert sum(t for _, _, t in events) == 2 * 2 * 32 and events[-1][0] == 1

    quant = QuantConfig(scheme=Scheme.INT8, act=ActQuant.STATIC, smooth=0.5)
    stages = []
    result = run_quantize(QuantizeJob(model=str(model_dir), output=tmp_path / "q", quant=quant, stats=job.output,
                                      device="cpu"), lambda *e: stages.append(e))
    assert result.device == "cpu" and result.bytes > 0 and (result.output / "model.safetensors").exists()
    assert [s for s in dict.fromkeys(s for s, _, _ in stages)] == ["smooth layers", RECAPTURE, "quantize layers"]
    assert stages[-1] == ("quantize layers", 2, 2)
    meta = json.loads((result.output / "fllama_meta.json").read_text())
    assert meta["calibration_data"] == {"source": str(text_file), "samples": 2, "seq_len": 32}  # the stats' text


def test_static_activations_need_stats(tmp_path):
    with pytest.raises(ConfigError, match="need calibration stats"):
        QuantizeJob(model=None, output=tmp_path, quant=QuantConfig(scheme=Scheme.INT8, act=ActQuant.STATIC))
