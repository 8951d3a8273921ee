"""`--calibrator output` (calibrate/fp8_act_range.py): each static fp8 range chosen by the error it causes at the
outputs of the linears reading it, their weights quantized; the checkpoint stays compressed-tensors' static fp8."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from calibrate.calibration import DataConfig
from calibrate.fp8_act_range import (OutputRangeConfig, QuantizedLinear, candidates, channel_errors, choose_amax,
                                     output_errors, static_scale, token_weights)
from calibrate.methods import CalibConfig, CalibMethod
from calibrate.pipeline import CalibrateJob, QuantizeJob, run_calibrate, run_quantize
from calibrate.quantize import QuantConfig
from calibrate.ranges import compute_amax
from calibrate.stats import CalibStats
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme
from model_zoo.quant.fp8 import FP8_MAX, quantize_weight_fp8
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear
from tests.test_cli import assert_one_line_error, fllama

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=256, name="fp8-act-range")


def _linear(w: torch.Tensor) -> QuantizedLinear:
    return QuantizedLinear(w, *quantize_weight_fp8(w))


def _wide_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """|x| spread over many binades (log-normal, median 0.018, largest ~100), so the range decides how many
    values fall to the subnormals; channel 0 carries a rare outlier of 4000 in 4 tokens: [tokens, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).sign() * torch.exp(2.0 * torch.randn(tokens, k, generator=g) - 4.0)
    x[:4, 0] = 4000.0  # [T, K]
    return x


def test_output_errors_are_the_static_fp8_linears_own_errors():
    g = torch.Generator().manual_seed(1)
    x, lins = torch.randn(64, 32, generator=g) * 3, [_linear(torch.randn(n, 32, generator=g)) for n in (16, 8)]
    amaxes = [2.0, 9.5]
    ours = output_errors(x, lins, amaxes)
    for amax, err in zip(amaxes, ours):
        direct = sum(float(((Fp8Linear(l.codes, l.scale, ActQuant.STATIC, float(static_scale(amax)),
                                       dtype=torch.float32)(x) - x @ l.weight.T) ** 2).sum()) for l in lins)
        assert float(err) == pytest.approx(direct, rel=1e-4)


def test_channel_errors_estimate_the_output_errors_ranking():
    g = torch.Generator().manual_seed(2)
    codes, scale = quantize_weight_fp8(torch.randn(40, 48, generator=g))
    x = _wide_inputs(512, 48, seed=3)
    lins = [QuantizedLinear(codes.float() * scale[:, None], codes, scale)]  # W = W8: the activations' error alone
    amaxes = [4000.0 * 2.0 ** (-j / 2) for j in range(10)]
    exact, rough = output_errors(x, lins, amaxes), channel_errors(x, lins, amaxes)
    assert int(torch.argmin(exact)) == int(torch.argmin(rough))
    assert torch.allclose(rough, exact, rtol=0.3)


@pytest.mark.parametrize("weight_on_outlier, clips", [(0.0, True), (30.0, False)])
def test_an_outlier_is_clipped_only_where_no_large_weight_reads_it(weight_on_outlier, clips):
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(4))  # [N, K]
    w[:, 0] = weight_on_outlier
    x = _wide_inputs(1024, 48, seed=5)
    calibrated = {"max": 4000.0, "entropy": 100.0}
    amax, report = choose_amax(x, [_linear(w)], calibrated, OutputRangeConfig(per_token=False))
    assert (amax < 4000.0) is clips
    assert report["amax"] == amax and report["error_vs_calibrator"] <= 1.0


def test_per_token_errors_weigh_a_massive_token_as_one_token():
    """Four tokens whose outputs are ~100x the others': judged against their own outputs, clipping them by a
    few percent costs less than the precision every other token loses to a range 40x wider than theirs."""
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(4))  # [N, K]
    w[:, 0] = 30.0
    x = _wide_inputs(1024, 48, seed=5)
    calibrated = {"max": 4000.0, "entropy": 100.0}
    lins = [_linear(w)]
    amax, _ = choose_amax(x, lins, calibrated, OutputRangeConfig())
    assert amax < 4000.0
    w_t = token_weights(x, lins)
    assert float(output_errors(x, lins, [amax], w_t)[0]) < float(output_errors(x, lins, [4000.0], w_t)[0])


def test_candidates_are_the_calibrators_and_a_grid_below_the_largest_value():
    got = candidates({"max": 8.0, "mse": 3.0}, observed=10.0, cfg=OutputRangeConfig(steps=2, octaves=3))
    assert got == sorted(got) and 8.0 in got and 3.0 in got and got[-1] == 10.0 and got[0] == pytest.approx(10 / 8)
    with pytest.raises(ConfigError, match="at least one token"):
        OutputRangeConfig(tokens=0)


def test_output_is_a_quantize_time_fp8_calibrator():
    assert QuantConfig(scheme=Scheme.FP8, act=ActQuant.STATIC, calibrator=CalibMethod.OUTPUT).reads_text
    with pytest.raises(ConfigError, match="--calibrator output applies to --scheme fp8"):
        QuantConfig(scheme=Scheme.INT8, act=ActQuant.STATIC, calibrator=CalibMethod.OUTPUT)
    with pytest.raises(ConfigError, match="fllama quantize"):
        CalibConfig(method=CalibMethod.OUTPUT)
    with pytest.raises(ConfigError, match="quantized model"):
        compute_amax(CalibMethod.OUTPUT, torch.ones(4), torch.arange(5.0))
    assert CalibMethod.OUTPUT not in CalibConfig().methods  # `fllama calibrate --method all`: histograms only


def test_output_calibrated_checkpoint_is_static_fp8_with_scales_among_the_candidates(model_dir, text_file,
                                                                                     tmp_path):
    stats = tmp_path / "s.safetensors"
    run_calibrate(CalibrateJob(model=str(model_dir), output=stats, calib=CalibConfig(), device="cpu",
                               data=DataConfig(source=str(text_file), samples=4, seq_len=32)))
    quant = QuantConfig(scheme=Scheme.FP8, act=ActQuant.STATIC, calibrator=CalibMethod.OUTPUT)
    out = run_quantize(QuantizeJob(model=str(model_dir), output=tmp_path / "q", quant=quant, stats=stats,
                                   device="cpu")).output
    meta = json.loads((out / "fllama_meta.json").read_text())
    assert meta["calibrator"] == "output" and meta["act"] == "static"
    stored = load_file(str(out / "model.safetensors"))
    scales = {k: v for k, v in stored.items() if k.endswith("input_scale")}
    assert len(scales) == 2 * 7 and all(v.shape == (1,) and v.dtype == torch.float32 for v in scales.values())
    p = CalibStats.load(stats).points["layers.0.qkv"]
    top = max(p.amax, compute_amax(CalibMethod.MSE, p.hist, p.edges, CalibConfig(), "fp8"))
    amax = float(stored["model.layers.0.self_attn.q_proj.input_scale"][0]) * FP8_MAX
    assert 0 < amax <= top * 1.0001 and amax >= top / 2 ** OutputRangeConfig().octaves * 0.9999
    lin = build_weights(load_model(str(out)), torch.float32, "cpu").layers[0].wq
    assert isinstance(lin, Fp8Linear) and lin.act is ActQuant.STATIC


def test_output_calibrator_misuse_is_one_line(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "int8", "--act", "static",
                          "--calibrator", "output", "--stats", tmp_path / "s.safetensors", "-o", tmp_path / "q")
    assert_one_line_error(code, err, "--calibrator output applies to --scheme fp8")
    code, _, err = fllama(capsys, monkeypatch, "calibrate", model_dir, "--method", "output", "-o", tmp_path / "s")
    assert_one_line_error(code, err, "needs the quantized weights")
    assert not (tmp_path / "q").exists() and not (tmp_path / "s").exists()
