"""layer_input=choose: per layer, the search input whose quantized output lands closer to the float model's."""

import pytest
import torch

from calibrate.awq import AwqConfig, LayerInput
from calibrate.awq_results import load_awq_results, save_awq_results
from calibrate.capture import CaptureConfig
from calibrate.quantize import QuantConfig, quantize_awq
from model_zoo.config import LlamaConfig
from model_zoo.quant.formats import Scheme
from model_zoo.weights import ModelWeights, random_state_dict

CONFIG = LlamaConfig(64, 3, 4, 2, 128, 300, name="tiny-gqa3")


def _run(layer_input):
    weights = ModelWeights.from_state_dict(CONFIG, random_state_dict(CONFIG, seed=5))
    windows = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(6))  # [n, L]
    cfg = AwqConfig(layer_input=layer_input, n_grid=4, clip_grid=4)
    return quantize_awq(weights, QuantConfig(scheme=Scheme.AWQ, group_size=16), windows, CaptureConfig(batch=2), cfg)


@pytest.fixture(scope="module")
def chosen():
    return _run("choose")


def test_choose_reports_each_layers_input_and_is_deterministic(chosen):
    qweights, report = chosen
    layers = report["layers"]
    assert "input" in layers[0] and layers[0]["input"] is None  # layer 0 reads the embeddings: nothing to choose
    for entry in layers[1:]:
        losses = {c: entry["losses"][f"input.{c}"] for c in ("scaled", "float")}
        assert entry["input"] == min(losses, key=losses.get)  # the candidate with the smaller output error
        assert all(v > 0 for v in losses.values())
    again_weights, again = _run(LayerInput.CHOOSE)
    assert again == report
    for a, b in zip(qweights.layers, again_weights.layers):
        assert torch.equal(a.wq.dense_weight(), b.wq.dense_weight())


def test_choose_layer_matches_the_fixed_input_it_picked(chosen):
    """A layer searched on the input CHOOSE picked gets the losses of that fixed layer_input's search (layer 1:
    both streams start from the same layer 0)."""
    _, report = chosen
    picked = report["layers"][1]["input"]
    _, fixed = _run(picked)
    got = {k: v for k, v in report["layers"][1]["losses"].items() if not k.startswith("input.")}
    assert got == fixed["layers"][1]["losses"]


def test_chosen_input_saved_and_read_back(tmp_path):
    from calibrate.awq_config import AwqLayerResult
    layers = [AwqLayerResult(scales={"qkv": torch.ones(64)}, chosen_input=c) for c in (None, "float", "scaled")]
    save_awq_results(tmp_path / "s.safetensors", layers, AwqConfig(layer_input="choose"))
    back = load_awq_results(tmp_path / "s.safetensors")
    assert [r.chosen_input for r in back.layers] == [None, "float", "scaled"]
    assert back.config.layer_input is LayerInput.CHOOSE
