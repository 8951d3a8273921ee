"""AWQ int4 rounded by GPTQ at the grid the search fixed (calibrate/awq_gptq.py): the format of round-to-nearest
(the same steps and zero points, codes 0..15, no permutation), read by AutoAWQ's own dequantizer, with less output
error than nearest rounding on inputs the Hessians never saw; `--rounding` end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from calibrate.awq import AwqConfig, apply_awq, search_layer
from calibrate.awq_gptq import gptq_awq
from calibrate.capture import CaptureConfig
from calibrate.gptq_round import GptqConfig, LayerHessians, Rounding
from calibrate.pipeline import QuantizeJob, run_quantize
from calibrate import quantize
from calibrate.quantize import AWQ_GPTQ, DEFAULT_AWQ_ROUNDING, AwqMethod, QuantConfig, awq_gptq_notes
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.load import load_model
from model_zoo.quant.awq_pack import dequantize_awq, quantize_awq, quantize_awq_rtn, unpack_awq
from model_zoo.quant.checkpoint import build_weights
from model_zoo.quant.formats import Scheme
from model_zoo.quant.linear import AwqLinear
from model_zoo.reference import layer_forward
from model_zoo.text_sources import load_text, token_windows
from model_zoo.weights import ModelWeights, random_state_dict
from tests.test_awq_pack import _load_packing_utils
from tests.test_cli import assert_one_line_error, fllama
from tests.test_fp8_gptq import _hessian, _inputs

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=128, vocab_size=512,
                  max_positions=256, name="awq-gptq")


def _out_err(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (wq - w).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


def _weight(seed: int) -> torch.Tensor:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(seed)) * 0.05  # [N, K]
    w[::5, 7] = 0.4  # outliers: some groups' ranges are set by one weight
    return w


def test_gptq_keeps_the_grid_and_moves_held_out_outputs_less():
    w, h, held_out = _weight(1), _hessian(_inputs(2048, 128, seed=2)), _inputs(1024, 128, seed=3)
    clip = w.abs().reshape(48, 4, 32).amax(dim=2) * 0.8  # [N, K/G]: as the clip search gives
    lin = gptq_awq(w, h, 32, clip)
    q, zeros, scales = quantize_awq_rtn(w, 32, clip)
    assert torch.equal(lin.scales, scales) and torch.equal(unpack_awq(lin.qzeros), zeros)  # the same grid
    codes = unpack_awq(lin.qweight)  # [K, N]
    assert codes.max() <= 15 and (codes != q).float().mean() > 0.05  # rounded differently, on the grid
    rtn = AwqLinear(*quantize_awq(w, 32, clip), 32, dtype=torch.float32).dense_weight()
    gptq, nearest = _out_err(w, lin.dense_weight(), held_out), _out_err(w, rtn, held_out)
    assert gptq < 0.8 * nearest, (gptq, nearest)
    again = gptq_awq(w, h, 32, clip, GptqConfig(block=7))  # blocks change the speed, not the result (to fp32)
    assert (unpack_awq(again.qweight) != codes).float().mean() < 0.01


def test_a_diagonal_hessian_leaves_round_to_nearest():
    w = _weight(4)
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(5)) + 0.5).double()  # [K, K]
    h[3, 3] = 0.0  # an input never seen
    lin = gptq_awq(w, h, 32)
    qweight, qzeros, scales = quantize_awq(w, 32)
    assert torch.equal(lin.qweight, qweight) and torch.equal(lin.qzeros, qzeros) and torch.equal(lin.scales, scales)
    with pytest.raises(ConfigError, match="Hessian of shape"):
        gptq_awq(w, h[:10, :10], 32)


def test_autoawqs_dequantizer_reads_gptq_codes():
    pu = _load_packing_utils()
    lin = gptq_awq(_weight(6).half(), _hessian(_inputs(1024, 128, seed=7)), 32)
    theirs = pu.dequantize_gemm(lin.qweight, lin.qzeros, lin.scales, 4, 32)  # [K, N] fp16
    assert torch.equal(theirs, dequantize_awq(lin.qweight, lin.qzeros, lin.scales, 32, torch.float16).T)


def test_rounding_is_an_fp8_and_awq_option():
    awq = QuantConfig(scheme=Scheme.AWQ)
    assert awq.rounding is DEFAULT_AWQ_ROUNDING and awq.describe()["rounding"] == DEFAULT_AWQ_ROUNDING.value
    rtn = QuantConfig(scheme=Scheme.AWQ, awq_method=AwqMethod.RTN)
    assert rtn.rounding is Rounding.NEAREST and not rtn.reads_text
    assert QuantConfig(scheme=Scheme.AWQ, rounding=Rounding.NEAREST).reads_text  # the search still reads text
    short = awq_gptq_notes(awq, 4096)  # too little text for GPTQ's Hessians: say so, once
    assert len(short) == 1 and "4,096 tokens" in short[0] and "--rounding nearest" in short[0]
    assert awq_gptq_notes(awq, AWQ_GPTQ.tokens) == [] and awq_gptq_notes(rtn, 4096) == []
    with pytest.raises(ConfigError, match="--rounding gptq needs --method awq"):
        QuantConfig(scheme=Scheme.AWQ, awq_method=AwqMethod.RTN, rounding=Rounding.GPTQ)
    with pytest.raises(ConfigError, match="--rounding applies to --scheme fp8 and awq only"):
        QuantConfig(scheme=Scheme.INT8, rounding=Rounding.NEAREST)


def _layer_error(checkpoint, float_weights, windows: torch.Tensor) -> float:
    """Each layer of `checkpoint` fed the float model's hidden states on `windows` [n, L]: its output's squared
    distance from the float layer's, summed over layers, relative to the float outputs'."""
    quantized = build_weights(load_model(str(checkpoint)), torch.float32, "cpu")
    hidden = float_weights.embed[windows]  # [n, L, H]
    positions = torch.arange(windows.shape[1]).expand(windows.shape)  # [n, L]
    err = total = 0.0
    for fl, ql in zip(float_weights.layers, quantized.layers):
        ref, out = (layer_forward(lay, CFG, hidden, positions) for lay in (fl, ql))  # [n, L, H] each
        err, total = err + float((out - ref).pow(2).sum()), total + float((ref - hidden).pow(2).sum())
        hidden = ref
    return err / total


def test_gptq_checkpoint_round_trips_and_beats_nearest_on_held_out_text(model_dir, text_file, tmp_path):
    pu = _load_packing_utils()
    out = {}
    for rounding in Rounding:
        quant = QuantConfig(scheme=Scheme.AWQ, group_size=32, rounding=rounding)
        out[rounding] = run_quantize(QuantizeJob(model=str(model_dir), output=tmp_path / rounding.value, quant=quant,
                                                 data=str(text_file), samples=64, seq_len=64, device="cpu")).output
    meta = json.loads((out[Rounding.GPTQ] / "fllama_meta.json").read_text())
    assert meta["rounding"] == "gptq" and meta["awq_search"]["gptq_tokens"] == 64 * 64
    stored = load_file(str(out[Rounding.GPTQ] / "model.safetensors"))
    loaded = build_weights(load_model(str(out[Rounding.GPTQ])), torch.float32, "cpu")
    p = "model.layers.1.mlp.down_proj"
    theirs = pu.dequantize_gemm(stored[f"{p}.qweight"], stored[f"{p}.qzeros"], stored[f"{p}.scales"], 4, 32)
    assert torch.equal(theirs.T, loaded.layers[1].w_down.dense_weight().half())  # fp32 holds (q - z) * s exactly
    nearest = load_file(str(out[Rounding.NEAREST] / "model.safetensors"))
    assert torch.equal(stored[f"{p}.scales"], nearest[f"{p}.scales"])  # same search, same grid
    assert not torch.equal(stored[f"{p}.qweight"], nearest[f"{p}.qweight"])
    float_weights = build_weights(load_model(str(model_dir)), torch.float32, "cpu")
    tok = load_model(str(model_dir)).tokenizer
    held_out = token_windows(tok.encode(load_text("gutenberg:sherlock")[30000:40000]), 64, 16 * 64)  # [16, 64]
    gptq, rtn = (_layer_error(out[r], float_weights, held_out) for r in (Rounding.GPTQ, Rounding.NEAREST))
    assert gptq < 0.9 * rtn, (gptq, rtn)


def test_rounding_gptq_with_rtn_is_one_line(capsys, monkeypatch, model_dir, tmp_path):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "awq", "--method", "rtn",
                          "--rounding", "gptq", "-o", tmp_path / "q", "--device", "cpu")
    assert_one_line_error(code, err, "--rounding gptq needs --method awq")
    assert not (tmp_path / "q").exists()


def test_quantize_awq_rounds_with_its_gptq_config():
    config = LlamaConfig(64, 2, 4, 2, 128, 300, name="tiny-gptq")
    weights = ModelWeights.from_state_dict(config, random_state_dict(config, seed=5))
    windows = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(6))  # [n, L]
    qcfg = QuantConfig(scheme=Scheme.AWQ, group_size=32)
    awq = AwqConfig(search_tokens=64)  # the search reads 2 windows, GPTQ as many as its config says

    def run(gptq: GptqConfig):
        q, report = quantize.quantize_awq(weights, qcfg, windows, CaptureConfig(batch=2), awq, gptq=gptq)
        return [unpack_awq(lin.qweight) for layer in q.layers for lin in layer.linears().values()], report

    base, report = run(AWQ_GPTQ)
    assert report["search_tokens"] == 64 and report["gptq_tokens"] == 128
    # layer 0 by hand: GPTQ aims at the scaled weights before clipping, on the grid the clips set
    result = search_layer(weights.layers[0], config, weights.embed[windows], replace(awq, group_size=32))
    scaled = apply_awq(weights.layers[0], result, config)
    target = apply_awq(weights.layers[0], replace(result, clips={}), config).w_down.dense_weight()  # [N, K]
    h = LayerHessians(weights, windows, CaptureConfig(batch=2), AWQ_GPTQ).hessians(scaled)["down"]
    want = gptq_awq(target, h, 32, result.clips["w_down"], AWQ_GPTQ)
    assert torch.equal(unpack_awq(want.qweight), base[6])  # linears in LINEAR_NAMES order: w_down last
    for other in (replace(AWQ_GPTQ, damp=1.0), replace(AWQ_GPTQ, tokens=64)):
        codes, _ = run(other)
        assert any(not torch.equal(a, b) for a, b in zip(base, codes))
