"""FP8 ranges (issue 42): MSE and entropy judged on e4m3's grid choose other ranges than on int8's, and those
ranges minimise the real e4m3 error; the range report carries both grids; the quantize pipeline writes the
calibrated fp8 input scales."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from calibrate import fp8_grid
from calibrate.calibration import DataConfig, range_report
from calibrate.collectors import HistogramCollector
from calibrate.methods import CalibConfig, CalibMethod, QuantGrid
from calibrate.pipeline import CalibrateJob, QuantizeJob, run_calibrate, run_quantize
from calibrate.quantize import QuantConfig
from calibrate.ranges import amax_entropy, amax_mse, compute_amax, fake_quant, scale_from_amax, sqnr_db, sqnr_db_from_hist
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant.formats import Scheme
from model_zoo.quant.fp8 import FP8_MAX
from model_zoo.quant.int8 import ActQuant

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=256, name="fp8-calib-tiny")


def _hist(x: torch.Tensor):
    c = HistogramCollector(bins=2048)
    c.collect(x)
    return c.hist, c.edges


def _outliers(n: int = 1_000_000) -> torch.Tensor:
    """A Gaussian bulk with a few large values: int8's MSE clips them, e4m3's exponent can keep them."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))  # [n]
    x[:4] = torch.tensor([100.0, -50.0, 25.0, -12.0])
    return x


def _fp8_mse(x: torch.Tensor, amax: float) -> float:
    return float(((fp8_grid.fake_quant_fp8(x, amax) - x).double() ** 2).mean())


def test_the_grid_is_e4m3s():
    assert fp8_grid.GRID.size == 127 and fp8_grid.GRID[1] == 2.0 ** -9 and fp8_grid.GRID[-1] == FP8_MAX
    assert scale_from_amax(448.0, QuantGrid.FP8) == 1.0 and scale_from_amax(127.0) == 1.0


@pytest.mark.parametrize("dist", ["outliers", "laplace"])
def test_fp8_mse_minimises_the_real_e4m3_error_and_differs_from_int8(dist):
    x = _outliers() if dist == "outliers" else torch.distributions.Laplace(0.0, 1.0).sample((1_000_000,))
    hist, edges = _hist(x)
    a_fp8, a_int8 = amax_mse(hist, edges, grid=QuantGrid.FP8), amax_mse(hist, edges)
    assert a_fp8 != a_int8
    centres = ((edges[1:] + edges[:-1]) / 2)[128::96].tolist()  # the candidates, every 96th
    best = min(_fp8_mse(x, a) for a in centres)
    assert _fp8_mse(x, a_fp8) <= best * 1.002  # what the histogram model picks is the real e4m3 optimum
    assert _fp8_mse(x, a_fp8) < _fp8_mse(x, a_int8)  # and int8's choice is worse on e4m3 ...
    int8_err = lambda a: float(((fake_quant(x, a) - x).double() ** 2).mean())
    assert int8_err(a_int8) < int8_err(a_fp8)  # ... as e4m3's is on int8


def test_on_outliers_fp8_keeps_the_range_int8_clips():
    x = _outliers()
    hist, edges = _hist(x)
    for method in (CalibMethod.MSE, CalibMethod.ENTROPY):
        a_int8, a_fp8 = compute_amax(method, hist, edges), compute_amax(method, hist, edges, grid=QuantGrid.FP8)
        assert a_int8 < 30 and a_fp8 > 90, (method, a_int8, a_fp8)  # 100 is the max
        assert sqnr_db(x, fp8_grid.fake_quant_fp8(x, a_fp8)) > sqnr_db(x, fp8_grid.fake_quant_fp8(x, a_int8)) + 5
    for method in (CalibMethod.MAX, CalibMethod.PERCENTILE):  # these do not look at the grid
        assert compute_amax(method, hist, edges) == compute_amax(method, hist, edges, grid=QuantGrid.FP8)


def test_fp8_entropy_levels_are_the_e4m3_values_the_centres_round_to():
    cand = np.array([128, 517, 2048])
    starts = fp8_grid.level_starts(cand)  # [3, 128]
    for row, i in zip(starts, cand):
        centres = torch.from_numpy(448.0 * (np.arange(i) + 0.5) / i)
        codes = torch.bucketize(centres, torch.from_numpy(fp8_grid.GRID[1:] + fp8_grid.GRID[:-1]) / 2, right=True)
        assert np.array_equal(np.searchsorted(row[1:], np.arange(i), side="right"), codes.numpy())
        assert row[-1] == i


def test_fp8_entropy_is_deterministic_and_clips_no_more_than_the_data_needs():
    x = torch.distributions.Laplace(0.0, 1.0).sample((500_000,))
    hist, edges = _hist(x)
    a = amax_entropy(hist, edges, grid=QuantGrid.FP8)
    assert a == amax_entropy(hist, edges, grid=QuantGrid.FP8)
    assert 0.5 * float(x.abs().max()) < a <= float(edges[-1])


def test_histogram_sqnr_estimates_the_real_fp8_one():
    x = torch.distributions.Laplace(0.0, 1.0).sample((400_000,))
    hist, edges = _hist(x)
    for amax in (2.0, 6.0, float(x.abs().max())):
        est = sqnr_db_from_hist(hist, edges, amax, QuantGrid.FP8)
        assert est == pytest.approx(sqnr_db(x, fp8_grid.fake_quant_fp8(x, amax)), abs=0.1)


def test_table_and_direct_mse_agree():
    x = torch.distributions.Laplace(0.0, 1.0).sample((200_000,))
    h, e = (t.double().numpy() for t in _hist(x))
    cand = np.arange(128, 2048, 7)
    table = fp8_grid.mse_curve(h, e, cand) * e[1] ** 2 / FP8_MAX ** 3 / h.sum()
    direct = fp8_grid._mse_direct(h, e, (e[cand] + e[cand + 1]) / 2)
    assert np.allclose(table, direct, rtol=1e-5, atol=0)  # the table is float32
    assert direct[np.argmin(table)] <= direct.min() * (1 + 1e-6)


def test_quant_config_accepts_fp8_static_and_smoothquant():
    cfg = QuantConfig(scheme=Scheme.FP8, act=ActQuant.STATIC, smooth=0.5)
    assert cfg.needs_stats and cfg.calibrator is CalibMethod.MAX  # docs/quality.md
    assert cfg.describe() == {"scheme": "fp8", "act": "static", "smooth": 0.5, "calibrator": "max", "rounding": "gptq",
                              "weight_scale": "search"}
    with pytest.raises(ConfigError, match="int8 and fp8, not awq"):
        QuantConfig(scheme=Scheme.AWQ, act=ActQuant.STATIC)


def test_calibrate_report_then_static_fp8_scales(model_dir, text_file, tmp_path):
    stats = run_calibrate(CalibrateJob(model=str(model_dir), output=tmp_path / "s.safetensors",
                                       data=DataConfig(source=str(text_file), samples=2, seq_len=32),
                                       calib=CalibConfig(), device="cpu"))
    report = range_report(stats, CalibConfig())
    row = report["layers.1.down"]
    assert set(row) == {"max", "percentile", "mse", "entropy"}
    p = stats.points["layers.1.down"]
    for m in ("mse", "entropy"):
        assert row[m]["fp8"]["amax"] == compute_amax(m, p.hist, p.edges, CalibConfig(), QuantGrid.FP8)
        assert row[m]["fp8"]["scale"] == pytest.approx(row[m]["fp8"]["amax"] / FP8_MAX)
        assert row[m]["amax"] == compute_amax(m, p.hist, p.edges, CalibConfig())  # int8 stays at the top level
    for method in ("entropy", "max"):
        quant = QuantConfig(scheme=Scheme.FP8, act=ActQuant.STATIC, calibrator=CalibMethod(method))
        out = run_quantize(QuantizeJob(model=str(model_dir), output=tmp_path / method, quant=quant,
                                       stats=tmp_path / "s.safetensors", device="cpu")).output
        sd = load_file(str(out / "model.safetensors"))
        input_scale = sd["model.layers.1.mlp.down_proj.input_scale"]
        assert input_scale.dtype == torch.float32 and input_scale.shape == (1,)
        want = row[method]["fp8"]["amax"] if method != "max" else p.amax
        assert float(input_scale) == float(torch.tensor(want, dtype=torch.float32) / FP8_MAX)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "tensor"
        meta = json.loads((out / "fllama_meta.json").read_text())
        assert meta["scheme"] == "fp8" and meta["calibrator"] == method
