"""Checkpoint layouts: config JSON, reading/writing tensors, errors, and compressed-tensors reading our int8 export."""

import json

import pytest
import torch

from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.linear import DenseLinear
from model_zoo.quant.awq_pack import quantize_awq
from model_zoo.quant.formats import (Scheme, amax_as_stored, awq_quantization_config, describe_quantization,
                                     export_tensors_int8, export_tensors_linear, int8_quantization_config,
                                     linear_factory_for, load_quantized_weights, scheme_of)
from model_zoo.quant.int8 import ActQuant, quantize_weight_int8
from model_zoo.quant.linear import AwqLinear, Int8Linear
from model_zoo.weights import LINEAR_NAMES, random_state_dict

TINY = LlamaConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=128, vocab_size=256)
P = "model.layers.0.self_attn.q_proj"


def _int8_sd(config: LlamaConfig, a_amax: float | None, seed: int = 0) -> tuple[dict, dict]:
    """(dense fp16 state dict, its int8 export with fp16 scales)."""
    dense = random_state_dict(config, seed=seed, dtype=torch.float16)
    out = {}
    for name, t in dense.items():
        if name.endswith("_proj.weight"):
            qweight, w_scale = quantize_weight_int8(t, scale_dtype=torch.float16)
            out.update(export_tensors_int8(name[: -len(".weight")], qweight, w_scale, a_amax))
        else:
            out[name] = t
    return dense, out


# --- config JSON (REFERENCE.md section 2) -----------------------------------------------------------------------

def test_int8_config_json_is_the_reference_layout():
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    weights = {**int8, "strategy": "channel", "dynamic": False}
    for static, act in ((False, {**int8, "strategy": "token", "dynamic": True}),
                        (True, {**int8, "strategy": "tensor", "dynamic": False})):
        assert int8_quantization_config(static) == {
            "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}}}
        json.dumps(int8_quantization_config(static))  # plain JSON


def test_awq_config_json_is_the_reference_layout():
    assert awq_quantization_config(128) == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                            "version": "gemm", "modules_to_not_convert": None}
    with pytest.raises(ModelSourceError, match="zero_point"):
        awq_quantization_config(64, zero_point=False)


def test_scheme_of_and_describe():
    assert scheme_of(None) is Scheme.FP16 and scheme_of({}) is Scheme.FP16
    assert scheme_of(int8_quantization_config(False)) is Scheme.INT8
    assert scheme_of(awq_quantization_config(64)) is Scheme.AWQ
    assert describe_quantization(int8_quantization_config(True)) == {"scheme": "int8", "act": ["static"]}
    assert describe_quantization(awq_quantization_config(32)) == {"scheme": "awq", "group_size": 32}
    # AutoAWQ's own spelling of the keys and version
    assert scheme_of({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"}) is Scheme.AWQ


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"}, "GEMM"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "3 bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "group_size"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
])
def test_scheme_of_refuses_what_fllama_cannot_run(cfg, match):
    with pytest.raises(ModelSourceError, match=match):
        scheme_of(cfg)


def _ct(**group_changes) -> dict:
    cfg = int8_quantization_config(False)
    group = cfg["config_groups"]["group_0"]
    for key, value in group_changes.items():
        group[key] = value if value is None else {**group[key], **value}
    return cfg


@pytest.mark.parametrize("cfg,match", [
    (_ct(input_activations=None), "W8A8"),  # weight-only int8
    (_ct(weights={"strategy": "group", "group_size": 128}), "per output"),
    (_ct(weights={"num_bits": 4}), "per output"),
    (_ct(input_activations={"type": "float"}), "W8A8"),
    (_ct(input_activations={"strategy": "token", "dynamic": False}), "token"),
    ({**int8_quantization_config(False), "format": "float-quantized"}, "float-quantized"),
    ({**int8_quantization_config(False), "quantization_status": "frozen"}, "frozen"),
    ({**int8_quantization_config(False), "kv_cache_scheme": {"num_bits": 8}}, "KV cache"),
])
def test_compressed_tensors_configs_fllama_refuses(cfg, match):
    with pytest.raises(ModelSourceError, match=match):
        scheme_of(cfg)


# --- reading tensors ----------------------------------------------------------------------------------------------

def test_int8_factory_reads_static_and_dynamic():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    qweight, w_scale = quantize_weight_int8(w, scale_dtype=torch.float16)
    sd = export_tensors_int8(P, qweight, w_scale, a_amax=3.0)
    assert sd[f"{P}.weight_scale"].shape == (32, 1) and sd[f"{P}.weight_scale"].dtype == torch.float16
    assert sd[f"{P}.input_scale"].shape == (1,)
    static = linear_factory_for(Scheme.INT8, int8_quantization_config(True))(P, sd)
    assert isinstance(static, Int8Linear) and static.act is ActQuant.STATIC
    assert torch.equal(static.qweight, qweight) and torch.equal(static.w_scale, w_scale)
    assert static.a_amax == pytest.approx(3.0, rel=1e-3)  # through an fp16 input_scale
    dynamic = linear_factory_for(Scheme.INT8, int8_quantization_config(False))(P, sd)
    assert dynamic.act is ActQuant.DYNAMIC and dynamic.a_amax is None


def test_amax_as_stored_is_what_a_reader_gets_back():
    for amax in (2.0, 3.7, 0.013, 417.0):
        stored = amax_as_stored(amax)
        assert stored == pytest.approx(amax, rel=1e-3) and amax_as_stored(stored) == stored
        qweight, w_scale = quantize_weight_int8(torch.randn(8, 16))
        lin = linear_factory_for(Scheme.INT8, int8_quantization_config(True))(
            P, export_tensors_int8(P, qweight, w_scale, amax))
        assert lin.a_amax == stored


def test_int8_ignore_list_and_regex_keep_modules_dense():
    sd = {f"{P}.weight": torch.randn(8, 8)}
    for ignore in ([P], ["re:.*q_proj$"]):
        lin = linear_factory_for(Scheme.INT8, int8_quantization_config(False, ignore=ignore))(P, sd)
        assert isinstance(lin, DenseLinear)


@pytest.mark.parametrize("mutate,match", [
    (lambda sd: sd.pop(f"{P}.weight_scale"), "weight_scale"),
    (lambda sd: sd.__setitem__(f"{P}.weight", sd[f"{P}.weight"].float()), "int8"),
    (lambda sd: sd.__setitem__(f"{P}.weight_scale", sd[f"{P}.weight_scale"][:7]), r"\[8, 1\]"),
    (lambda sd: sd.__setitem__(f"{P}.weight_scale", -sd[f"{P}.weight_scale"]), "non-positive"),
    (lambda sd: sd.pop(f"{P}.input_scale"), "input_scale"),
    (lambda sd: sd.__setitem__(f"{P}.input_scale", torch.ones(2)), "one float"),
    (lambda sd: sd.__setitem__(f"{P}.weight_zero_point", torch.ones(8, 1, dtype=torch.int8)), "zero_point"),
])
def test_int8_factory_refuses_inconsistent_tensors(mutate, match):
    qweight, w_scale = quantize_weight_int8(torch.randn(8, 16))
    sd = export_tensors_int8(P, qweight, w_scale, a_amax=1.0)
    mutate(sd)
    with pytest.raises(CorruptCheckpointError, match=match):
        linear_factory_for(Scheme.INT8, int8_quantization_config(True))(P, sd)


def _awq_sd(k=128, n=32, g=32):
    qweight, qzeros, scales = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), g)
    return {f"{P}.qweight": qweight, f"{P}.qzeros": qzeros, f"{P}.scales": scales}


@pytest.mark.parametrize("mutate,match", [
    (lambda sd: sd.pop(f"{P}.qzeros"), "qzeros"),
    (lambda sd: sd.__setitem__(f"{P}.qweight", sd[f"{P}.qweight"].to(torch.int64)), "int32"),
    (lambda sd: sd.__setitem__(f"{P}.scales", sd[f"{P}.scales"][:, :16]), r"scales has shape \(4, 16\)"),
    (lambda sd: sd.__setitem__(f"{P}.qzeros", sd[f"{P}.qzeros"][:2]), r"qzeros has shape \(2, 4\)"),
])
def test_awq_factory_refuses_inconsistent_tensors(mutate, match):
    sd = _awq_sd()
    mutate(sd)
    with pytest.raises(CorruptCheckpointError, match=match):
        linear_factory_for(Scheme.AWQ, awq_quantization_config(32))(P, sd)


def test_awq_factory_group_size_from_config_must_divide_k():
    with pytest.raises(CorruptCheckpointError, match="does not divide"):
        linear_factory_for(Scheme.AWQ, awq_quantization_config(96))(P, _awq_sd(k=128))


def test_awq_modules_to_not_convert_stay_dense():
    cfg = {**awq_quantization_config(32), "modules_to_not_convert": ["self_attn"]}
    lin = linear_factory_for(Scheme.AWQ, cfg)(P, {f"{P}.weight": torch.randn(8, 8)})
    assert isinstance(lin, DenseLinear)
    assert isinstance(linear_factory_for(Scheme.AWQ, awq_quantization_config(32))(P, _awq_sd()), AwqLinear)


# --- whole models -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("static", [False, True])
def test_int8_export_load_round_trip_is_bit_exact(static):
    dense, exported = _int8_sd(TINY, 2.0 if static else None)
    weights = load_quantized_weights(TINY, exported, int8_quantization_config(static), torch.float16)
    assert weights.meta["scheme"] == "int8" and weights.embed.dtype == torch.float16
    x = torch.randn(5, TINY.hidden_size, generator=torch.Generator().manual_seed(2)).half()
    for attr, path in LINEAR_NAMES[:1] + LINEAR_NAMES[4:5]:
        lin = getattr(weights.layers[1], attr)
        w = dense[f"model.layers.1.{path}.weight"]
        built = Int8Linear.from_dense(w, ActQuant.STATIC if static else ActQuant.DYNAMIC,
                                      amax_as_stored(2.0) if static else None, scale_dtype=torch.float16)
        assert torch.equal(lin(x), built(x))
        again = export_tensors_linear("m", lin)
        assert torch.equal(again["m.weight"], exported[f"model.layers.1.{path}.weight"])
        assert torch.equal(again["m.weight_scale"], exported[f"model.layers.1.{path}.weight_scale"])


def test_awq_whole_model_loads_and_reports_size():
    dense = random_state_dict(TINY, seed=3, dtype=torch.float16)
    sd = {}
    for name, t in dense.items():
        if name.endswith("_proj.weight"):
            sd.update(export_tensors_linear(name[: -len(".weight")], AwqLinear.from_dense(t, 32)))
        else:
            sd[name] = t
    weights = load_quantized_weights(TINY, sd, awq_quantization_config(32), torch.float16)
    assert all(isinstance(lin, AwqLinear) for layer in weights.layers for lin in layer.linears().values())
    fp16 = load_quantized_weights(TINY, dense, None, torch.float16)
    assert weights.nbytes() < fp16.nbytes()
    w_hat = weights.layers[0].w_down.dense_weight().float()
    w = dense["model.layers.0.mlp.down_proj.weight"].float()
    assert (w_hat - w).norm() / w.norm() < 0.1


def test_fused_inputs_share_the_largest_static_amax():
    _, exported = _int8_sd(TINY, 2.0)
    exported["model.layers.0.self_attn.k_proj.input_scale"] = torch.tensor([5.0 / 127], dtype=torch.float16)
    weights = load_quantized_weights(TINY, exported, int8_quantization_config(True), torch.float16)
    layer0, layer1 = weights.layers
    assert layer0.wq.a_amax == layer0.wk.a_amax == layer0.wv.a_amax == amax_as_stored(5.0)
    assert layer0.w_gate.a_amax == layer0.wo.a_amax == layer1.wk.a_amax == amax_as_stored(2.0)


def test_mismatched_checkpoint_is_refused():
    _, exported = _int8_sd(TINY, None)
    with pytest.raises(CorruptCheckpointError):
        load_quantized_weights(TINY.replace(ffn_size=256), exported, int8_quantization_config(False), torch.float16)


# --- compressed-tensors' own code reads our int8 export --------------------------------------------------------

def test_compressed_tensors_decompresses_our_export_exactly():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    for static in (False, True):
        cfg = int8_quantization_config(static)
        qcfg = QuantizationConfig.model_validate(cfg)  # their schema accepts our JSON
        scheme = qcfg.config_groups["group_0"]
        assert scheme.weights.strategy == "channel" and scheme.input_activations.dynamic is (not static)
        compressor = BaseCompressor.get_value_from_registry(cfg["format"])
        w = torch.randn(48, 80, generator=torch.Generator().manual_seed(4)).half()
        qweight, w_scale = quantize_weight_int8(w, scale_dtype=torch.float16)
        tensors = export_tensors_int8("m", qweight, w_scale, 1.5 if static else None)
        theirs = compressor.decompress({k[2:]: v for k, v in tensors.items()}, scheme)["weight"]
        ours = Int8Linear(qweight, w_scale, dtype=torch.float16).dense_weight()
        assert theirs.dtype == torch.float16 and torch.equal(theirs, ours), ct.__version__


def _hf_dir(tmp_path, static: bool):
    from safetensors.torch import save_file

    dense, exported = _int8_sd(TINY.replace(n_layers=1), 3.0 if static else None, seed=5)
    save_file(exported, str(tmp_path / "model.safetensors"))
    hf = {**TINY.replace(n_layers=1).to_hf(), "quantization_config": int8_quantization_config(static)}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return exported


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("static", [False, True])
def test_transformers_loads_our_int8_checkpoint(tmp_path, static):
    """transformers + compressed-tensors, their way: dequantized weights equal ours, quantized forward agrees."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    exported = _hf_dir(tmp_path, static)
    config = LlamaConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    ours = load_quantized_weights(config, exported, int8_quantization_config(static), torch.float16)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    for attr, path in LINEAR_NAMES:
        theirs = plain.state_dict()[f"model.layers.0.{path}.weight"]
        assert torch.equal(theirs, getattr(ours.layers[0], attr).dense_weight()), path

    # compressed mode: their forward fake-quantizes inputs with our input_scale (or per token)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    model(torch.tensor([[1, 2, 3]]))  # the first forward decompresses in place
    x = (torch.rand(6, TINY.hidden_size, generator=torch.Generator().manual_seed(6)) * 5.6 - 2.8).half()
    for attr, path in LINEAR_NAMES[:4]:
        module = model.get_submodule(f"model.layers.0.{path}")
        y_theirs, y_ours = module(x).float(), getattr(ours.layers[0], attr)(x).float()
        # they compute x / scale in fp16 and, per token, scale = amax / 127.5: some codes differ by one step
        # (measured 2.5e-3 static, 5.4e-3 dynamic; a scale/amax mix-up would be off by 127x)
        assert (y_theirs - y_ours).norm() / y_ours.norm() < (5e-3 if static else 1e-2), path
