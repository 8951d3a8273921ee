"""FP8 E4M3 W8A8 (issue 42): the numerics against torch's float8 cast, Fp8Linear, the checkpoint layout read and
written, other tools' fp8 layouts, and bad checkpoints refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError, ModelSourceError
from model_zoo.linear import DenseLinear
from model_zoo.quant.formats import (Scheme, describe_quantization, export_tensors_fp8, export_tensors_linear,
                                     fp8_quantization_config, int8_quantization_config, linear_factory_for,
                                     load_quantized_weights, scheme_of)
from model_zoo.quant.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_weight_fp8, fp8_gemm_ref, quantize_act_fp8,
                                 quantize_act_fp8_per_token, quantize_weight_fp8, to_e4m3)
from model_zoo.quant.int8 import ActQuant
from model_zoo.quant.linear import Fp8Linear
from model_zoo.weights import LINEAR_NAMES, random_state_dict
from tests.test_cli import assert_one_line_error, fllama

CFG = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=256, name="fp8-tiny")
P = "model.layers.0.self_attn.q_proj"
CPU = ("--device", "cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- numerics ---------------------------------------------------------------------------------------------------

def test_to_e4m3_rounds_half_to_even_and_saturates():
    # [1, 2) has steps of 1/8: 1.0625 lies halfway between 1.0 (even) and 1.125; 1.1875 between 1.125 and 1.25 (even)
    v = torch.tensor([1.0625, 1.1875, -1.0625, 1000.0, -1e6, 464.0, 448.0, 2.0 ** -10, 3 * 2.0 ** -11])
    want = torch.tensor([1.0, 1.25, -1.0, 448.0, -448.0, 448.0, 448.0, 0.0, 2.0 ** -9])
    assert torch.equal(to_e4m3(v).float(), want)
    x = torch.randn(4096, generator=_gen(0)) * torch.logspace(-4, 3, 4096)  # every binade, in range and beyond
    ours = to_e4m3(x)
    assert ours.dtype == FP8_DTYPE
    assert torch.equal(ours.view(torch.uint8), x.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))


def test_weight_codes_are_per_channel_with_scale_amax_over_448():
    w = torch.randn(24, 80, generator=_gen(1)) * torch.logspace(-3, 1, 24)[:, None]
    w8, w_scale = quantize_weight_fp8(w)
    assert w8.dtype == FP8_DTYPE and w8.shape == w.shape and w_scale.dtype == torch.float32
    assert torch.equal(w_scale, w.abs().amax(1) / FP8_MAX)
    assert torch.equal(w8.float().abs().amax(1), torch.full((24,), FP8_MAX))  # each row's max lands on 448
    assert torch.equal(w8.view(torch.uint8), to_e4m3(w / w_scale[:, None]).view(torch.uint8))
    back = dequantize_weight_fp8(w8, w_scale)
    assert ((back - w).abs() <= w.abs() * 2.0 ** -4 + w_scale[:, None] * 2.0 ** -10).all()  # half a step


def test_activation_scales_per_token_and_static():
    x = torch.randn(2, 5, 48, generator=_gen(2)) * 3
    x8, s = quantize_act_fp8_per_token(x)
    assert s.shape == (2, 5) and torch.equal(s, x.abs().amax(-1) / FP8_MAX)
    assert torch.equal(x8.view(torch.uint8), to_e4m3(x * (1.0 / s)[..., None]).view(torch.uint8))
    x8s, ss = quantize_act_fp8(x, 0.002)  # a small static scale: large values saturate at +-448
    assert torch.all(ss == torch.tensor(0.002)) and x8s.float().abs().max() == FP8_MAX
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError):
            quantize_act_fp8(x, bad)


def test_gemm_reference_is_the_product_of_codes_then_scales():
    x8, s = quantize_act_fp8_per_token(torch.randn(7, 96, generator=_gen(3)))
    w8, ws = quantize_weight_fp8(torch.randn(40, 96, generator=_gen(4)))
    y = fp8_gemm_ref(x8, w8, s, ws, torch.float32)
    exact = (x8.double() @ w8.double().T) * s.double()[:, None] * ws.double()[None, :]
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="float8"):
        fp8_gemm_ref(x8.float(), w8, s, ws, torch.float32)


def test_fp8_linear_call_dense_to_and_bytes():
    w = torch.randn(32, 64, generator=_gen(5))
    x = torch.randn(3, 4, 64, generator=_gen(6))
    for act, a_scale in ((ActQuant.DYNAMIC, None), (ActQuant.STATIC, 4.0 / FP8_MAX)):
        lin = Fp8Linear.from_dense(w, act, a_scale)
        x8, s = (quantize_act_fp8_per_token(x) if a_scale is None else quantize_act_fp8(x, a_scale))
        want = fp8_gemm_ref(x8.reshape(-1, 64), lin.weight8, s.reshape(-1), lin.w_scale, torch.float32)
        assert torch.equal(lin(x), want.reshape(3, 4, 32))
        assert lin(x.half()).dtype == torch.float16
        assert lin.nbytes() == 32 * 64 + 32 * 4 + (4 if a_scale else 0)
        moved = lin.to(dtype=torch.bfloat16)
        assert moved.dense_weight().dtype == torch.bfloat16 and torch.equal(moved(x), lin(x))
        rel = (lin(x) - x @ w.T).norm() / (x @ w.T).norm()
        assert rel < 0.06, rel  # e4m3 keeps ~4 significant bits on both operands
    per_tensor = Fp8Linear(lin.weight8, torch.tensor([0.01]))  # other tools' per-tensor weight scales
    assert per_tensor.w_scale.shape == (32,) and torch.all(per_tensor.w_scale == 0.01)


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)), "float8_e4m3fn"),
    ((torch.zeros(4, 8).to(FP8_DTYPE), torch.ones(3)), "3 entries"),
    ((torch.zeros(4, 8).to(FP8_DTYPE), -torch.ones(4)), "positive"),
    ((torch.zeros(4, 8).to(FP8_DTYPE), torch.ones(4), ActQuant.STATIC), "needs a_scale"),
    ((torch.zeros(4, 8).to(FP8_DTYPE), torch.ones(4), ActQuant.DYNAMIC, 0.1), "takes none"),
])
def test_fp8_linear_refuses_inconsistent_parts(args, match):
    with pytest.raises(ConfigError, match=match):
        Fp8Linear(*args)


# --- the checkpoint layout --------------------------------------------------------------------------------------

def test_config_json_is_what_vllm_and_compressed_tensors_read():
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    for static, act in ((False, {"strategy": "token", "dynamic": True}), (True, {"strategy": "tensor", "dynamic": False})):
        assert fp8_quantization_config(static) == {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**fp8, **act}}}}
    assert scheme_of(fp8_quantization_config(True)) is Scheme.FP8
    assert scheme_of(int8_quantization_config(True)) is Scheme.INT8
    assert describe_quantization(fp8_quantization_config(False)) == {
        "scheme": "fp8", "act": ["dynamic"], "weight_scales": ["channel"],
        "format": "compressed-tensors float-quantized"}


def _fp8_sd(a_scale: float | None, seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in random_state_dict(CFG, seed=seed, dtype=torch.float16).items():
        if name.endswith("_proj.weight"):
            out.update(export_tensors_fp8(name[: -len(".weight")], *quantize_weight_fp8(t), a_scale))
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("static", [False, True])
def test_export_then_load_is_bit_exact(static):
    sd = _fp8_sd(0.0123 if static else None)
    assert sd[f"{P}.weight"].dtype == FP8_DTYPE and sd[f"{P}.weight_scale"].shape == (64, 1)
    assert sd[f"{P}.weight_scale"].dtype == torch.float32
    assert (f"{P}.input_scale" in sd) is static and (not static or sd[f"{P}.input_scale"].shape == (1,))
    weights = load_quantized_weights(CFG, sd, fp8_quantization_config(static), torch.float16)
    for i, layer in enumerate(weights.layers):
        for attr, path in LINEAR_NAMES:
            lin, prefix = getattr(layer, attr), f"model.layers.{i}.{path}"
            assert isinstance(lin, Fp8Linear) and lin.act is (ActQuant.STATIC if static else ActQuant.DYNAMIC)
            again = export_tensors_linear(prefix, lin)
            assert set(again) == {k for k in sd if k.startswith(prefix + ".")}
            assert all(torch.equal(again[k].view(torch.uint8) if again[k].dtype == FP8_DTYPE else again[k],
                                   sd[k].view(torch.uint8) if sd[k].dtype == FP8_DTYPE else sd[k]) for k in again)
            assert lin.a_scale == (pytest.approx(0.0123, rel=1e-7) if static else None)


def test_fused_inputs_share_the_largest_static_scale():
    sd = _fp8_sd(0.01)
    sd["model.layers.0.self_attn.k_proj.input_scale"] = torch.tensor([0.03])
    layer = load_quantized_weights(CFG, sd, fp8_quantization_config(True), torch.float32).layers[0]
    assert layer.wq.a_scale == layer.wk.a_scale == layer.wv.a_scale == pytest.approx(0.03)
    assert layer.wo.a_scale == pytest.approx(0.01)


def _llm_compressor_fp8(strategy: str = "tensor") -> dict:
    """llm-compressor's FP8 preset (per-tensor weights, static per-tensor inputs) as it writes config.json."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "sparsity_config": {}, "transform_config": {}, "version": "0.20.0",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": {**args, "strategy": strategy},
                                          "input_activations": {**args, "strategy": "tensor",
                                                                "observer": "static_minmax"},
                                          "output_activations": None}}}


def test_per_tensor_weight_scales_and_autofp8_layout_load():
    w = torch.randn(64, 64, generator=_gen(7))
    w8 = to_e4m3(w / 0.02)
    sd = {f"{P}.weight": w8, f"{P}.weight_scale": torch.tensor([0.02]), f"{P}.input_scale": torch.tensor([0.05])}
    ct = linear_factory_for(Scheme.FP8, _llm_compressor_fp8())(P, sd)
    assert torch.equal(ct.to(dtype=torch.float32).dense_weight(), w8.float() * torch.tensor(0.02))
    assert ct.a_scale == pytest.approx(0.05)
    native = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    sd_scalar = {**sd, f"{P}.weight_scale": torch.tensor(0.02), f"{P}.input_scale": torch.tensor(0.05)}  # 0-d
    lin = linear_factory_for(Scheme.FP8, native)(P, sd_scalar)
    assert scheme_of(native) is Scheme.FP8 and lin.act is ActQuant.STATIC and torch.equal(lin(w), ct(w))
    dyn = linear_factory_for(Scheme.FP8, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "ignored_layers": ["model.layers.0.self_attn.q_proj"]})
    assert isinstance(dyn(P, {f"{P}.weight": w.half()}), DenseLinear)  # an ignored layer stays dense
    assert describe_quantization(native)["format"] == "fp8 (AutoFP8 / vLLM)"


def _ct_changed(**changes) -> dict:
    cfg = _llm_compressor_fp8()
    group = cfg["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key] = None if value is None else {**group[key], **value}
        else:
            cfg[key] = value
    return cfg


def _mixed() -> dict:
    cfg = _llm_compressor_fp8()
    int8 = int8_quantization_config(False)["config_groups"]["group_0"]
    cfg["config_groups"]["group_1"] = {**int8, "format": "int-quantized", "targets": ["re:.*down_proj"]}
    return cfg


@pytest.mark.parametrize("cfg,match", [
    (_ct_changed(weights={"strategy": "block", "block_structure": [128, 128]}), "per tensor"),
    (_ct_changed(weights={"strategy": "group", "group_size": 128}), "per output channel or per tensor"),
    (_ct_changed(input_activations={"strategy": "group", "group_size": 128, "dynamic": True}), "strategy"),
    (_ct_changed(input_activations={"type": "int"}), "W8A8"),
    (_ct_changed(weights={"num_bits": 4}), "8-bit"),
    (_ct_changed(input_activations=None), "W8A8"),
    (_ct_changed(sparsity_config={"format": "sparse-24-bitmask"}), "sparse"),
    (_ct_changed(transform_config={"config_groups": {"u": {}}}), "rotated"),
    (_mixed(), "mixes int and float"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "activation_scheme"),
])
def test_fp8_layouts_fllama_cannot_run_are_refused(cfg, match):
    with pytest.raises(ModelSourceError, match=match):
        scheme_of(cfg)


@pytest.mark.parametrize("mutate,match", [
    (lambda sd: sd.update({f"{P}.weight": sd[f"{P}.weight"].float()}), "float8_e4m3fn"),
    (lambda sd: sd.pop(f"{P}.weight_scale"), "lacks the tensor"),
    (lambda sd: sd.update({f"{P}.weight_scale": -sd[f"{P}.weight_scale"]}), "non-positive"),
    (lambda sd: sd.update({f"{P}.weight_scale": torch.ones(63, 1)}), "weight_scale"),
    (lambda sd: sd.pop(f"{P}.input_scale"), "input_scale"),
    (lambda sd: sd.update({f"{P}.input_scale": torch.tensor([float("nan")])}), "non-finite"),
    (lambda sd: sd.update({f"{P}.weight_zero_point": torch.ones(64, 1)}), "zero"),
    (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].to(FP8_DTYPE)}), "stay wide"),
])
def test_inconsistent_fp8_tensors_are_refused(mutate, match):
    sd = _fp8_sd(0.01)
    mutate(sd)
    with pytest.raises(CorruptCheckpointError, match=match):
        load_quantized_weights(CFG, sd, fp8_quantization_config(True), torch.float16)


# --- the CLI, end to end on a tiny checkpoint --------------------------------------------------------------------

def test_quantize_info_eval_generate_fp8(capsys, monkeypatch, model_dir, tmp_path):
    code, out, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "fp8", "-o", tmp_path / "q",
                            *CPU, "--json")
    assert code == 0, err
    assert json.loads(out)["scheme"] == "fp8" and json.loads(out)["act"] == "dynamic"
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert stored[f"{P}.weight"].dtype == FP8_DTYPE and stored["model.embed_tokens.weight"].dtype == torch.float16
    code, out, err = fllama(capsys, monkeypatch, "info", tmp_path / "q", "--json")
    info = json.loads(out)
    assert info["scheme"] == "fp8" and info["stored_dtype"] == "float8_e4m3fn"
    assert info["quant_format"].startswith("compressed-tensors float-quantized (e4m3, weight scales per channel")
    code, out, err = fllama(capsys, monkeypatch, "generate", tmp_path / "q", "-p", "Holmes", "-n", "4",
                            "--temperature", "0", *CPU, "--json")
    assert code == 0, err
    code, out, err = fllama(capsys, monkeypatch, "eval", tmp_path / "q", "--data", "gutenberg:sherlock",
                            "--seq-len", "32", "--max-tokens", "128", "--baseline", model_dir, *CPU, "--json")
    result = json.loads(out)
    assert code == 0 and result["kl_divergence"] < 0.05 and result["top1_agreement"] > 0.7, result


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "not a readable safetensors"),
    ("int8-codes", "float8_e4m3fn"),
    ("block-config", "block-wise"),
])
def test_a_corrupt_fp8_checkpoint_is_one_line(capsys, monkeypatch, model_dir, tmp_path, damage, needle):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "fp8", "-o", tmp_path / "q", *CPU)
    assert code == 0, err
    st, cfg_path = tmp_path / "q" / "model.safetensors", tmp_path / "q" / "config.json"
    if damage == "truncate":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    elif damage == "int8-codes":
        sd = load_file(str(st))
        sd[f"{P}.weight"] = sd[f"{P}.weight"].view(torch.int8).clone()
        save_file(sd, str(st))
    else:
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        cfg_path.write_text(json.dumps(cfg))
    code, _, err = fllama(capsys, monkeypatch, "generate", tmp_path / "q", "-p", "x", "-n", "2", *CPU)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("args,needle", [
    (["--group-size", "64"], "--group-size applies to --scheme awq only, not fp8"),
    (["--method", "rtn"], "--method applies to --scheme awq"),
    (["--act", "static"], "need calibration stats"),
    (["--calibrator", "mse"], "--calibrator"),
])
def test_fp8_options_that_do_not_apply_are_one_line(capsys, monkeypatch, model_dir, tmp_path, args, needle):
    code, _, err = fllama(capsys, monkeypatch, "quantize", model_dir, "--scheme", "fp8", *args, "-o",
                          tmp_path / "q", *CPU)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "q").exists()
