import pytest
import torch
import torch.nn.functional as F

from calibrate.awq import (AwqConfig, AwqLayerResult, apply_awq, check_group_size, fake_quant_groups,
                           load_awq_results, save_awq_results, search_clip, search_layer, valid_group_sizes)
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError
from model_zoo.linear import DenseLinear
from model_zoo.reference import layer_forward
from model_zoo.weights import LINEAR_NAMES, ModelWeights, random_state_dict

MHA = LlamaConfig(64, 1, 4, 4, 128, 300, name="tiny-mha")
GQA = LlamaConfig(64, 1, 4, 2, 128, 300, name="tiny-gqa")
SALIENT = [3, 17, 40]
G = 16


def _layer(config, dtype=torch.float32, seed=0):
    return ModelWeights.from_state_dict(config, random_state_dict(config, seed=seed, dtype=dtype)).layers[0]


def _x(seed=1, batch=4, seq=32, dtype=torch.float32, salient=8.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 64, generator=g, dtype=dtype)  # [B, S, H]
    x[..., SALIENT] *= salient  # a few channels with large mean |x|
    return x


def _fwd(layer, config, x, observer=None):
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)  # [B, S]
    return layer_forward(layer, config, x, pos, observer=observer)


def _rtn_layer(layer, group_size):
    """Every linear round-to-nearest quantized (dequantized back to dense), norms untouched."""
    q = {a: DenseLinear(fake_quant_groups(getattr(layer, a).dense_weight(), group_size)) for a, _ in LINEAR_NAMES}
    return type(layer)(attn_norm=layer.attn_norm, ffn_norm=layer.ffn_norm, **q)


# --- the 4-bit rule -----------------------------------------------------------------------------


def test_fake_quant_known_answer():
    w = torch.tensor([[-1.0, 0.2, 0.75, 2.0],  # step 0.2, zero 5: codes 0, 6, 9, 15
                      [1.0, 1.25, 2.0, 4.0]])  # step 0.2, zero clamps to 0: 4.0 saturates at 15 * 0.2
    want = torch.tensor([[-1.0, 0.2, 0.8, 2.0], [1.0, 1.2, 2.0, 3.0]])
    assert torch.allclose(fake_quant_groups(w, 4), want, atol=1e-6)
    # groups are runs of consecutive input channels within a row
    assert torch.equal(fake_quant_groups(w, 2), fake_quant_groups(w.reshape(4, 2), 2).reshape(2, 4))
    # clipping clamps each group to [-c, c] before quantizing
    clip = torch.tensor([[1.5], [2.0]])
    assert torch.equal(fake_quant_groups(w, 4, clip), fake_quant_groups(w.clamp(-1.5, 1.5) * torch.tensor([[1.0], [0.0]])
                                                           + w.clamp(-2.0, 2.0) * torch.tensor([[0.0], [1.0]]), 4))
    # symmetric (zero_point=False): step max|w| / 7, codes -8..7
    sym = fake_quant_groups(torch.tensor([[-1.4, 0.35, 0.66, 0.1]]), 4, zero_point=False)
    assert torch.allclose(sym, torch.tensor([[-1.4, 0.4, 0.6, 0.0]]), atol=1e-6)


def test_fake_quant_matches_awq_packer():
    awq_pack = pytest.importorskip("model_zoo.quant.awq_pack")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)  # [N, K]
    clip = w.abs().reshape(24, 4, 16).amax(dim=2) * 0.8  # [N, K/G]
    for c in (None, clip):
        ours = fake_quant_groups(w, 16, c, scale_dtype=torch.float16)
        theirs = awq_pack.fake_quantize_awq(w, 16, c, dtype=torch.float32)
        assert torch.equal(ours, theirs)
    # without fp16 rounding of the step the two differ only by that rounding (now and then a code flips)
    diff = fake_quant_groups(w, 16) - awq_pack.fake_quantize_awq(w, 16, dtype=torch.float32)
    assert 0 < float(diff.abs().mean()) < 1e-3


# --- errors -------------------------------------------------------------------------------------


def test_group_size_that_does_not_divide():
    smol = LlamaConfig.from_name("smollm2-135m")
    with pytest.raises(ConfigError, match=r"group size 128 .*hidden 576.*that do: 8, 16, 24, 32, 48, 64, 96, 192"):
        check_group_size(smol, 128)
    assert valid_group_sizes(smol)[-1] == 192
    with pytest.raises(ConfigError, match="group size 48"):
        search_layer(_layer(MHA), MHA, _x(), AwqConfig(group_size=48))
    check_group_size(smol, 64)  # fine


@pytest.mark.parametrize("bad", [dict(group_size=0), dict(n_grid=0), dict(max_shrink=1.0), dict(max_shrink=-0.1),
                                 dict(clip_tokens=0), dict(search_tokens=2.5)])
def test_bad_config(bad):
    with pytest.raises(ConfigError):
        AwqConfig(**bad)


def test_bad_input_and_result_shapes():
    with pytest.raises(ConfigError, match="layer input"):
        search_layer(_layer(MHA), MHA, torch.randn(2, 8, 32), AwqConfig(group_size=G))
    with pytest.raises(ConfigError, match="MHA"):
        apply_awq(_layer(GQA), AwqLayerResult(scales={"o": torch.ones(64)}))


def test_shrink_ratios_follow_autoawq():
    r = AwqConfig().shrink_ratios
    assert len(r) == 10 and r[0] == 1.0 and abs(r[-1] - 0.55) < 1e-12
    assert AwqConfig(max_shrink=0.0).shrink_ratios == [1.0]


# --- the search ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
def test_scale_folding_is_exact(config):
    layer = _layer(config)
    x = _x()
    result = search_layer(layer, config, x, AwqConfig(group_size=G, clip=False, n_grid=5))
    assert not result.clips and ("o" in result.scales) == (config is MHA)
    folded = apply_awq(layer, result)
    assert not torch.equal(folded.wq.dense_weight(), layer.wq.dense_weight())
    assert torch.allclose(_fwd(folded, config, x), _fwd(layer, config, x), rtol=1e-5, atol=1e-5)
    # arbitrary positive scales fold exactly too (fp64: up to rounding only)
    layer64 = _layer(config, torch.float64)
    g = torch.Generator().manual_seed(3)
    sizes = {"qkv": 64, "o": config.q_size, "gate_up": 64, "down": 128}
    scales = {k: torch.rand(n, generator=g, dtype=torch.float64) * 4 + 0.1 for k, n in sizes.items()
              if k != "o" or config is MHA}
    out = _fwd(apply_awq(layer64, AwqLayerResult(scales=scales)), config, x.double())
    assert torch.allclose(out, _fwd(layer64, config, x.double()), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
def test_awq_beats_round_to_nearest(config):
    layer = _layer(config)
    calib, held_out = _x(seed=1), _x(seed=2)
    result = search_layer(layer, config, calib, AwqConfig(group_size=G))
    for name in result.scales:  # the grid includes alpha 0, so the search never loses to RTN on its data
        assert result.losses[name] <= result.losses[name + ".rtn"]
    for name in ("qkv", "gate_up"):  # salient channels -> a real scale (AWQ's point)
        assert result.alphas[name] > 0
        assert result.losses[name] < 0.9 * result.losses[name + ".rtn"]
    ref = _fwd(layer, config, held_out)
    err_rtn = (_fwd(_rtn_layer(layer, G), config, held_out) - ref).pow(2).mean()
    err_awq = (_fwd(_rtn_layer(apply_awq(layer, result), G), config, held_out) - ref).pow(2).mean()
    assert err_awq < 0.8 * err_rtn, (float(err_awq), float(err_rtn))


def test_losses_are_the_blocks_output_errors():
    """With alpha 0 only (scales 1), each loss equals the error measured through reference.layer_forward."""
    layer, x = _layer(MHA), _x()
    result = search_layer(layer, MHA, x, AwqConfig(group_size=G, n_grid=1, clip=False))
    assert all(torch.equal(s, torch.ones_like(s)) for s in result.scales.values())
    seen = {}
    _fwd(layer, MHA, x, observer=lambda p, a: seen.__setitem__(p, a))
    rtn = _rtn_layer(layer, G)
    w = {a: getattr(layer, a).dense_weight() for a, _ in LINEAR_NAMES}
    wq = {a: getattr(rtn, a).dense_weight() for a, _ in LINEAR_NAMES}

    def mse(a, b):
        return float((a - b).pow(2).mean())

    # qkv: self-attention output (o_proj in full precision) with q/k/v quantized
    qkv_only = type(layer)(**{**vars(layer), "wq": rtn.wq, "wk": rtn.wk, "wv": rtn.wv})
    seen_q = {}
    _fwd(qkv_only, MHA, x, observer=lambda p, a: seen_q.__setitem__(p, a))
    expect = {"qkv": mse(F.linear(seen_q["o"], w["wo"]), F.linear(seen["o"], w["wo"])),
              "o": mse(F.linear(seen["o"], wq["wo"]), F.linear(seen["o"], w["wo"])),
              "gate_up": mse(F.linear(F.silu(F.linear(seen["gate_up"], wq["w_gate"])) * F.linear(seen["gate_up"], wq["w_up"]),
                                      w["w_down"]), F.linear(seen["down"], w["w_down"])),
              "down": mse(F.linear(seen["down"], wq["w_down"]), F.linear(seen["down"], w["w_down"]))}
    for name, want in expect.items():
        assert result.losses[name] == pytest.approx(want, rel=1e-3), name
        assert result.losses[name + ".rtn"] == result.losses[name]


def test_clip_search_never_increases_group_error():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g, dtype=torch.float64)  # [N, K]
    w[:, 7] *= 6  # an outlier weight per row: clipping it pays off for some groups
    x = torch.randn(300, 64, generator=g, dtype=torch.float64)  # [T, K], T < clip_tokens: all used
    cfg = AwqConfig(group_size=G)
    clip, err, err_none = search_clip(w, x, cfg)
    assert clip.shape == (40, 4)

    def direct(c):  # AutoAWQ's form: per token and group, (x_g . (w_hat_g - w_g))^2, mean over tokens
        d = (fake_quant_groups(w, G, c) - w).reshape(40, 4, G)  # [N, K/G, G]
        out = torch.einsum("tgi,ngi->tng", x.reshape(300, 4, G), d)  # [T, N, K/G]
        return out.pow(2).mean(dim=0)  # [N, K/G]

    unclipped = w.abs().reshape(40, 4, G).amax(dim=2)
    e_best, e_none = direct(clip), direct(unclipped)
    assert torch.allclose(e_best, err, rtol=1e-9) and torch.allclose(e_none, err_none, rtol=1e-9)
    assert (e_best <= e_none * (1 + 1e-12)).all()
    assert (clip < unclipped).any() and (e_best < 0.95 * e_none).any()  # the search did clip somewhere
    ratios = torch.tensor(cfg.shrink_ratios, dtype=torch.float64)
    assert ((clip / unclipped)[..., None] - ratios).abs().min(dim=-1).values.max() < 1e-12


def test_layer_clip_losses_and_skipped_linears():
    result = search_layer(_layer(GQA), GQA, _x(), AwqConfig(group_size=G, n_grid=4))
    assert set(result.clips) == {"wv", "wo", "w_gate", "w_up", "w_down"}  # q and k never clipped
    assert result.clips["w_down"].shape == (64, 128 // G)
    for attr in result.clips:
        assert result.losses[f"clip.{attr}"] <= result.losses[f"clip.{attr}.none"]


def test_results_round_trip_through_safetensors(tmp_path):
    layers = [_layer(MHA, seed=s) for s in (0, 1)]
    cfg = AwqConfig(group_size=G, n_grid=4)
    results = [search_layer(l, MHA, _x(seed=s), cfg) for s, l in enumerate(layers)]
    path = tmp_path / "awq.safetensors"
    save_awq_results(path, results, cfg, meta={"model": "tiny-mha"})
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        assert {"layers.0.scales.qkv", "layers.1.scales.o", "layers.0.clips.wv"} <= set(f.keys())
    back = load_awq_results(path)
    assert back.config == cfg and back.meta == {"model": "tiny-mha"} and len(back.layers) == 2
    for layer, r, r2 in zip(layers, results, back.layers):
        assert r2.losses == r.losses and r2.alphas == r.alphas
        assert r2.scales.keys() == r.scales.keys() and r2.clips.keys() == r.clips.keys()
        a, b = apply_awq(layer, r), apply_awq(layer, r2)
        for attr, _ in LINEAR_NAMES:
            assert torch.equal(getattr(a, attr).dense_weight(), getattr(b, attr).dense_weight())
        assert torch.equal(a.attn_norm, b.attn_norm) and torch.equal(a.ffn_norm, b.ffn_norm)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CorruptCheckpointError):
        load_awq_results(bad)


def test_search_uses_the_first_samples_holding_search_tokens():
    layer, x = _layer(GQA), _x(batch=4, seq=32)
    cfg = AwqConfig(group_size=G, n_grid=4, search_tokens=40)  # 40 tokens -> the first 2 samples of 32
    a, b = search_layer(layer, GQA, x, cfg), search_layer(layer, GQA, x[:2], cfg)
    assert a.losses == b.losses and all(torch.equal(a.scales[k], b.scales[k]) for k in a.scales)
    c = search_layer(layer, GQA, x[:1], cfg)
    assert c.losses != a.losses
