"""fp8 weights chosen from calibration inputs: GPTQ rounding onto e4m3's grid (calibrate/fp8_gptq.py) and the
per-channel scale search (calibrate/fp8_scale.py) give lower layer-output error than round-to-nearest at amax / 448
in the same format (valid e4m3 codes within +-448, one fp32 scale per channel), and a checkpoint that round-trips
and that compressed-tensors' own decompressor reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from calibrate.fp8_gptq import gptq_fp8
from calibrate.gptq_round import GptqConfig, HessianCollector, Rounding
from calibrate.fp8_scale import CANDIDATES, Fp8WeightScale, search_scale_fp8
from calibrate.calibration import DataConfig
from calibrate.methods import CalibConfig
from calibrate.pipeline import CalibrateJob, QuantizeJob, run_calibrate, run_quantize
from calibrate.quantize import QuantConfig
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme, fp8_quantization_config
from model_zoo.quant.fp8 import FP8_DTYPE, FP8_MAX, dequantize_weight_fp8, quantize_weight_fp8, to_e4m3
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear
from tests.test_cli import assert_one_line_error, fllama

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=256, name="fp8-gptq")
P = "model.layers.1.mlp.down_proj"


def _inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs with a few loud channels, as a transformer's linears see them: [tokens, K]."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(99)) / k ** 0.5 + torch.eye(k)  # [K, K]
    loud = torch.ones(k)
    loud[::17] = 8.0
    return (torch.randn(tokens, k, generator=g) @ mix) * loud  # [T, K]


def _hessian(x: torch.Tensor) -> torch.Tensor:
    c = HessianCollector()
    for part in x.split(300):  # batch by batch, as the layer-wise runner feeds it
        c.collect(part)
    assert c.tokens == x.shape[0]
    return c.h


def _out_err(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (wq - w).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


def test_gptq_moves_layer_outputs_less_than_round_to_nearest():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05  # [N, K]
    h = _hessian(_inputs(2048, 96, seed=2))
    held_out = _inputs(1024, 96, seed=3)  # judged on inputs the Hessian never saw
    w8, w_scale = gptq_fp8(w, h)
    r8, r_scale = quantize_weight_fp8(w)
    assert torch.equal(w_scale, r_scale)  # the format's scale: amax / 448 per channel
    gptq, rtn = (_out_err(w, dequantize_weight_fp8(c, s), held_out) for c, s in ((w8, w_scale), (r8, r_scale)))
    assert gptq < 0.6 * rtn, (gptq, rtn)
    no_order = gptq_fp8(w, h, GptqConfig(act_order=False))
    assert _out_err(w, dequantize_weight_fp8(*no_order), held_out) < rtn


def test_the_searched_scale_moves_outputs_less_and_gptq_adds_to_it():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05  # [N, K]
    w[::5, 7] = 0.4  # rows with one outlier: clipping it is among the candidates
    h = _hessian(_inputs(2048, 96, seed=2))
    held_out = _inputs(1024, 96, seed=3)
    amax_scale = quantize_weight_fp8(w)[1]
    scale = search_scale_fp8(w, h)  # [N]
    ratios = scale / amax_scale
    assert all(any(abs(float(r) - c) < 1e-6 for c in CANDIDATES) for r in ratios) and (ratios != 1).any()
    rtn = _out_err(w, dequantize_weight_fp8(*quantize_weight_fp8(w)), held_out)
    searched = _out_err(w, dequantize_weight_fp8(to_e4m3(w / scale[:, None]), scale), held_out)
    both = _out_err(w, dequantize_weight_fp8(*gptq_fp8(w, h, scale=scale)), held_out)
    assert both < searched < rtn, (both, searched, rtn)
    w8, _ = gptq_fp8(w, h, scale=scale * 0.5)  # a scale that clips most of the row still gives valid codes
    assert w8.float().abs().max() == FP8_MAX and torch.isfinite(w8.float()).all()


def test_codes_are_valid_e4m3_within_448_even_when_errors_push_past_the_range():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) * 0.02
    w[:, 5] = 0.3  # the largest weight of each row sits in one column: compensation pushes later ones past amax
    w8, w_scale = gptq_fp8(w, _hessian(_inputs(1024, 64, seed=5)))
    assert w8.dtype == FP8_DTYPE and w8.shape == w.shape and w_scale.dtype == torch.float32
    codes = w8.float()
    assert torch.isfinite(codes).all() and codes.abs().max() <= FP8_MAX
    assert torch.equal(codes.to(FP8_DTYPE).float(), codes)


def test_uncorrelated_inputs_leave_nothing_to_compensate():
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(6))
    h = torch.diag(torch.rand(40, generator=torch.Generator().manual_seed(7)) + 0.5).double()  # [K, K] diagonal
    h[3, 3] = 0.0  # an input never seen
    w8, _ = gptq_fp8(w, h)
    assert torch.equal(w8.view(torch.uint8), quantize_weight_fp8(w)[0].view(torch.uint8))


def test_the_same_inputs_give_the_same_codes():
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(8))
    h = _hessian(_inputs(512, 48, seed=9))
    a, b = gptq_fp8(w, h, GptqConfig(block=7)), gptq_fp8(w, h, GptqConfig(block=7))
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    with pytest.raises(ConfigError, match="Hessian of shape"):
        gptq_fp8(w, h[:10, :10])


def test_rounding_and_scale_are_fp8_options_defaulting_to_gptq_and_search():
    cfg = QuantConfig(scheme=Scheme.FP8)
    assert cfg.rounding is Rounding.GPTQ and cfg.weight_scale is Fp8WeightScale.SEARCH and cfg.reads_text
    assert cfg.describe()["rounding"] == "gptq" and cfg.describe()["weight_scale"] == "search"
    for rounding, scale in ((Rounding.NEAREST, Fp8WeightScale.SEARCH), (Rounding.GPTQ, Fp8WeightScale.MAX)):
        assert QuantConfig(scheme=Scheme.FP8, rounding=rounding, weight_scale=scale).reads_text
    assert not QuantConfig(scheme=Scheme.FP8, rounding=Rounding.NEAREST, weight_scale=Fp8WeightScale.MAX).reads_text
    with pytest.raises(ConfigError, match="--rounding applies to --scheme fp8 and awq only"):
        QuantConfig(scheme=Scheme.INT8, rounding=Rounding.GPTQ)
    with pytest.raises(ConfigError, match="--weight-scale applies to --scheme fp8 only"):
        QuantConfig(scheme=Scheme.AWQ, weight_scale=Fp8WeightScale.MAX)
    with pytest.raises(ConfigError, match="damping"):
        GptqConfig(damp=0.0)


@pytest.mark.parametrize("act", [ActQuant.DYNAMIC, ActQuant.STATIC])
def test_gptq_checkpoint_round_trips_and_compressed_tensors_decompresses_it(model_dir, text_file, tmp_path, act):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    stats = None
    if act is ActQuant.STATIC:
        stats = tmp_path / "s.safetensors"
        run_calibrate(CalibrateJob(model=str(model_dir), output=stats, calib=CalibConfig(), device="cpu",
                                   data=DataConfig(source=str(text_file), samples=4, seq_len=32)))
    quant = QuantConfig(scheme=Scheme.FP8, act=act)
    out = run_quantize(QuantizeJob(model=str(model_dir), output=tmp_path / "q", quant=quant, stats=stats,
                                   data=str(text_file), samples=4, seq_len=32, device="cpu")).output
    meta = json.loads((out / "fllama_meta.json").read_text())
    assert meta["rounding"] == "gptq" and meta["weight_scale"] == "search" and meta["calibration_data"]["samples"] == 4
    stored = load_file(str(out / "model.safetensors"))
    w8, w_scale = stored[f"{P}.weight"], stored[f"{P}.weight_scale"]  # [N, K] e4m3, [N, 1] fp32
    assert w8.dtype == FP8_DTYPE and w_scale.shape == (w8.shape[0], 1) and w8.float().abs().max() <= FP8_MAX
    lin = build_weights(load_model(str(out)), torch.float32, "cpu").layers[1].w_down
    assert isinstance(lin, Fp8Linear) and torch.equal(lin.weight8.view(torch.uint8), w8.view(torch.uint8))
    dense = build_weights(load_model(str(model_dir)), torch.float32, "cpu").layers[1].w_down.dense_weight()
    ratio = w_scale.reshape(-1) / quantize_weight_fp8(dense)[1]  # searched: candidates x amax / 448
    assert all(any(abs(float(r) - c) < 1e-6 for c in CANDIDATES) for r in ratio)
    assert not torch.equal(w8.view(torch.uint8), quantize_weight_fp8(dense)[0].view(torch.uint8))  # GPTQ did work
    cfg = fp8_quantization_config(static=act is ActQuant.STATIC)
    scheme = QuantizationConfig.model_validate(cfg).config_groups["group_0"]
    theirs = BaseCompressor.get_value_from_registry(cfg["format"]).decompress(
        {"weight": w8, "weight_scale": w_scale}, scheme)["weight"]
    assert torch.equal(theirs.float(), lin.dense_weight().float())


def test_rounding_with_another_scheme_is_one_line(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "int8", "--rounding", "gptq",
                          "-o", tmp_path / "q", "--device", "cpu")
    assert_one_line_error(code, err, "--rounding applies to --scheme fp8 and awq only")
    assert not (tmp_path / "q").exists()


def test_gptq_hessians_read_the_first_gptq_tokens_of_the_text(model_dir, text_file):
    """quantize_fp8's `gptq` config says how much calibration text GPTQ's Hessians (and the scale search) read: with
    64 tokens of 4 windows of 32 the codes are those of the first 2 windows alone, and differ from all 4's."""
    from calibrate.calibration import calibration_windows
    from calibrate.quantize import FP8_GPTQ, quantize_fp8

    loaded = load_model(str(model_dir))
    weights = build_weights(loaded, torch.float32, "cpu")
    windows = calibration_windows(loaded.tokenizer, DataConfig(source=str(text_file), samples=4, seq_len=32),
                                  CFG.max_positions)  # [4, 32]
    cfg = QuantConfig(scheme=Scheme.FP8)

    def codes(model) -> torch.Tensor:
        return model.layers[1].w_down.weight8.view(torch.uint8)  # [N, K]

    first_two = codes(quantize_fp8(weights, cfg, None, windows=windows, gptq=GptqConfig(tokens=64)))
    assert torch.equal(first_two, codes(quantize_fp8(weights, cfg, None, windows=windows[:2])))
    assert not torch.equal(first_two, codes(quantize_fp8(weights, cfg, None, windows=windows)))
    assert FP8_GPTQ.tokens == 32768 and FP8_GPTQ.damp == GptqConfig().damp  # the default: 64 windows of 512
