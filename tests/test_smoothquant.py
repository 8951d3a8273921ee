import math

import pytest
import torch

from calibrate.smoothquant import apply_smoothing, smooth_scales
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.reference import layer_forward
from model_zoo.weights import ModelWeights, random_state_dict

CFG = LlamaConfig(64, 1, 4, 2, 128, 300, name="tiny-gqa")


def _layer(dtype=torch.float64, seed=0):
    layer = ModelWeights.from_state_dict(CFG, random_state_dict(CFG, seed=seed, dtype=dtype)).layers[0]
    # trained LLaMAs carry their outlier channels in the norm weights too (RMSNorm alone caps a
    # residual outlier at sqrt(H) times the rest)
    layer.attn_norm[5] *= 20
    layer.ffn_norm[5] *= 20
    return layer


def _inputs(dtype=torch.float64, outlier: float = 40.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, CFG.hidden_size, generator=g, dtype=dtype)  # [B, S, H]
    x[..., 5] *= outlier  # one outlier channel in the residual stream, as in real LLMs
    pos = torch.arange(16).expand(2, 16)  # [B, S]
    return x, pos


def _capture_max(layer, x, pos):
    seen = {}
    layer_forward(layer, CFG, x, pos, observer=lambda p, a: seen.__setitem__(p, a.abs().amax(dim=0)))
    return seen


def test_known_answer():
    act = torch.tensor([4.0, 1.0])
    w1 = torch.tensor([[1.0, 2.0], [0.5, -8.0]])
    w2 = torch.tensor([[-3.0, 0.5]])
    # per column the largest |W| over both weights: [3, 8]
    s = smooth_scales(act, [w1, w2], 0.5)
    assert torch.allclose(s, torch.tensor([2 / math.sqrt(3), 1 / math.sqrt(8)]), rtol=1e-6)
    assert torch.allclose(smooth_scales(act, [w1, w2], 1.0), act)
    assert torch.allclose(smooth_scales(act, [w1, w2], 0.0), torch.tensor([1 / 3, 1 / 8]))
    # zero channels are clamped, never 0 or inf
    z = smooth_scales(torch.tensor([0.0, 1.0]), [torch.zeros(1, 2)], 0.5)
    assert torch.isfinite(z).all() and (z > 0).all()


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_out_of_range(alpha):
    with pytest.raises(ConfigError, match="alpha"):
        smooth_scales(torch.ones(2), [torch.ones(1, 2)], alpha)
    with pytest.raises(ConfigError, match="alpha"):
        apply_smoothing(_layer(), torch.ones(64), torch.ones(64), alpha)


def test_shape_errors():
    with pytest.raises(ConfigError, match="input channels"):
        smooth_scales(torch.ones(3), [torch.ones(2, 2)], 0.5)
    with pytest.raises(ConfigError, match="at least one"):
        smooth_scales(torch.ones(3), [], 0.5)


def test_layer_output_invariant():
    layer = _layer()
    x, pos = _inputs()
    stats = _capture_max(layer, x, pos)
    smoothed = apply_smoothing(layer, stats["qkv"], stats["gate_up"], 0.85)
    assert smoothed is not layer and not torch.equal(smoothed.attn_norm, layer.attn_norm)
    assert smoothed.wo is layer.wo and smoothed.w_down is layer.w_down  # not smoothed
    ref = layer_forward(layer, CFG, x, pos)
    out = layer_forward(smoothed, CFG, x, pos)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


def _int8_per_token_linear(x, w):
    """Per-token symmetric int8 activations, per-output-channel int8 weights (FasterLLaMA's W8A8)."""
    a_s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # [T, 1]
    w_s = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # [N, 1]
    xq = torch.round(x / a_s).clamp(-127, 127) * a_s
    wq = torch.round(w / w_s).clamp(-127, 127) * w_s
    return xq @ wq.T


def _max_ratio(act_max):
    return float(act_max.max() / act_max.median())


def test_smoothing_flattens_outliers_and_cuts_int8_error():
    layer = _layer(torch.float32)
    x, pos = _inputs(torch.float32)
    before = {}
    layer_forward(layer, CFG, x, pos, observer=lambda p, a: before.__setitem__(p, a))
    maxes = {p: a.abs().amax(dim=0) for p, a in before.items()}
    smoothed = apply_smoothing(layer, maxes["qkv"], maxes["gate_up"], 0.5)
    after = {}
    layer_forward(smoothed, CFG, x, pos, observer=lambda p, a: after.__setitem__(p, a))
    for point, attrs in (("qkv", ("wq", "wk", "wv")), ("gate_up", ("w_gate", "w_up"))):
        assert _max_ratio(before[point].abs().amax(dim=0)) > 10
        assert _max_ratio(after[point].abs().amax(dim=0)) < _max_ratio(before[point].abs().amax(dim=0)) / 3
        for a in attrs:
            w0, w1 = getattr(layer, a).dense_weight(), getattr(smoothed, a).dense_weight()
            exact = before[point].double() @ w0.double().T  # [T, N]
            err0 = (_int8_per_token_linear(before[point], w0) - exact).norm()
            err1 = (_int8_per_token_linear(after[point], w1) - exact).norm()
            assert err1 < 0.7 * err0, (point, a, float(err0), float(err1))


def test_down_proj_smoothing_through_up_rows_is_exact_and_helps():
    import dataclasses
    from model_zoo.quant.int8 import fake_quant_linear
    from model_zoo.config import LlamaConfig
    from model_zoo.reference import layer_forward
    from model_zoo.weights import ModelWeights, random_state_dict

    config = LlamaConfig(64, 1, 4, 2, 96, 50, max_positions=64)
    w = ModelWeights.from_state_dict(config, random_state_dict(config, seed=9)).to(dtype=torch.float64)
    layer = w.layers[0]
    layer = dataclasses.replace(layer, w_up=type(layer.w_up)(layer.w_up.dense_weight().clone()))
    layer.w_up.weight[5] *= 40.0  # an outlier channel of the down_proj input
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    seen = {}
    layer_forward(layer, config, x, pos, observer=lambda k, t: seen.setdefault(k, t))
    maxes = {k: v.abs().amax(0) for k, v in seen.items()}
    smoothed = apply_smoothing(layer, maxes["qkv"], maxes["gate_up"], 0.5, maxes["down"])
    torch.testing.assert_close(layer_forward(smoothed, config, x, pos), layer_forward(layer, config, x, pos),
                               rtol=1e-10, atol=1e-10)
    seen2 = {}
    layer_forward(smoothed, config, x, pos, observer=lambda k, t: seen2.setdefault(k, t))
    a0, a1 = seen["down"].float(), seen2["down"].float()
    err = lambda a, wd: float((fake_quant_linear(a, wd.float()) - a @ wd.float().T).norm() / (a @ wd.float().T).norm())
    assert err(a1, smoothed.w_down.dense_weight()) < 0.5 * err(a0, layer.w_down.dense_weight())
