import dataclasses
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from calibrate.awq import (AwqConfig, AwqLayerResult, LayerInput, apply_awq, check_group_size, fake_quant_groups,
                           search_clip, search_layer, valid_group_sizes, working_weights)
from calibrate.awq_config import CLIP_INPUTS, SCALE_GROUPS, ClipObjective, ScaleGroup
from calibrate.awq_results import load_awq_results, save_awq_results
from calibrate.awq_scale import TiedColumns, awq_scales, loss_fn, search_scale, tied_columns, weight_mean
from calibrate.capture import CaptureConfig
from calibrate.outputs import temp_prefix
from calibrate.quantize import QuantConfig, quantize_awq
from model_zoo.quant.formats import Scheme
from model_zoo.quant.linear import AwqLinear
from model_zoo.reference import ReferenceModel
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError, CorruptCheckpointError, FllamaError
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
    """Every linear round-to-nearest quantized as the checkpoint holds it (fp16 steps), dequantized back to dense."""
    q = {a: DenseLinear(fake_quant_groups(getattr(layer, a).dense_weight(), group_size, scale_dtype=torch.float16))
         for a, _ in LINEAR_NAMES}
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
    with pytest.raises(ConfigError, match=r"\[32\] \(one per v_proj row\)"):  # o: one scale per v_proj row
        apply_awq(_layer(GQA), AwqLayerResult(scales={"o": torch.ones(64)}), GQA)


def test_shrink_ratios_follow_autoawq():
    r = AwqConfig().shrink_ratios
    assert len(r) == 10 and r[0] == 1.0 and abs(r[-1] - 0.55) < 1e-12
    assert AwqConfig(max_shrink=0.0).shrink_ratios == [1.0]


# --- the search ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
def test_scale_folding_is_exact(config):
    layer = _layer(config)
    x = _x()
    result = search_layer(layer, config, x, AwqConfig(group_size=G, clip=False, n_grid=5, gqa_o_scaling=True))
    assert not result.clips and result.scales["o"].shape == (config.kv_size,)
    folded = apply_awq(layer, result, config)
    assert not torch.equal(folded.wq.dense_weight(), layer.wq.dense_weight())
    assert torch.allclose(_fwd(folded, config, x), _fwd(layer, config, x), rtol=1e-5, atol=1e-5)
    # arbitrary positive scales fold exactly too (fp64: up to rounding only)
    layer64 = _layer(config, torch.float64)
    g = torch.Generator().manual_seed(3)
    sizes = {"qkv": 64, "o": config.kv_size, "gate_up": 64, "down": 128}
    scales = {k: torch.rand(n, generator=g, dtype=torch.float64) * 4 + 0.1 for k, n in sizes.items()}
    out = _fwd(apply_awq(layer64, AwqLayerResult(scales=scales), config), config, x.double())
    assert torch.allclose(out, _fwd(layer64, config, x.double()), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha", "gqa"])
def test_awq_beats_round_to_nearest(config):
    layer = _layer(config)
    calib, held_out = _x(seed=1), _x(seed=2)
    result = search_layer(layer, config, calib, AwqConfig(group_size=G))
    for name in result.scales:  # the grid includes alpha 0, so the search never loses to RTN on its data
        assert result.losses[name] <= result.losses[name + ".rtn"]
    for name in ("qkv", "gate_up"):  # salient channels -> a real scale (AWQ's point)
        assert result.alphas[name] is not None and not torch.equal(result.scales[name], torch.ones(64))
        assert result.losses[name] < 0.9 * result.losses[name + ".rtn"]
    ref = _fwd(layer, config, held_out)
    err_rtn = (_fwd(_rtn_layer(layer, G), config, held_out) - ref).pow(2).mean()
    err_awq = (_fwd(_rtn_layer(apply_awq(layer, result, config), G), config, held_out) - ref).pow(2).mean()
    assert err_awq < 0.8 * err_rtn, (float(err_awq), float(err_rtn))


def test_losses_are_the_blocks_output_errors():
    """With alpha 0 only (scales 1), each loss equals the error measured through reference.layer_forward."""
    layer, x = _layer(MHA), _x()
    result = search_layer(layer, MHA, x, AwqConfig(group_size=G, n_grid=1, clip=False, duo_scaling=False,
                                                   fp16_steps=True))
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


def test_clip_search_objectives():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g, dtype=torch.float64)  # [N, K]
    w[:, 7] *= 6  # an outlier weight per row: clipping it pays off for some groups
    x = torch.randn(300, 64, generator=g, dtype=torch.float64)  # [T, K], T < clip_tokens: all used
    x[:, 40:] += 0.7 * x[:, :24]  # inputs correlated across groups: the row objective sees what GROUP does not
    unclipped = w.abs().reshape(40, 4, G).amax(dim=2)  # [N, K/G]
    ratios = AwqConfig(group_size=G).shrink_ratios

    def group_errors(c):  # AutoAWQ's form: per token and group, (x_g . (w_hat_g - w_g))^2, mean over tokens
        d = (fake_quant_groups(w, G, c, scale_dtype=torch.float16) - w).reshape(40, 4, G)  # [N, K/G, G]
        return torch.einsum("tgi,ngi->tng", x.reshape(300, 4, G), d).pow(2).mean(dim=0)  # [N, K/G]

    def row_errors(c):  # mean over tokens of each output's squared error, the steps stored in fp16
        return (x @ (fake_quant_groups(w, G, c, scale_dtype=torch.float16) - w).T).pow(2).mean(dim=0)  # [N]

    clip, err, err_none = search_clip(w, x, AwqConfig(group_size=G, clip_objective="group", fp16_steps=True))
    assert clip.shape == (40, 4) and err.shape == err_none.shape == (40,)
    assert torch.allclose(err, row_errors(clip), rtol=1e-9) and torch.allclose(err_none, row_errors(unclipped), rtol=1e-9)
    each = torch.stack([group_errors(unclipped * r) for r in ratios])  # [R, N, K/G]
    assert torch.allclose(group_errors(clip), each.min(dim=0).values, rtol=1e-9)  # each group's own best
    assert (clip < unclipped).any()  # the search did clip somewhere
    assert ((clip / unclipped)[..., None] - torch.tensor(ratios, dtype=torch.float64)).abs().min(-1).values.max() < 1e-12

    row_clip, row_err, row_none = search_clip(w, x, AwqConfig(group_size=G, clip_objective="row", fp16_steps=True))
    assert torch.allclose(row_err, row_errors(row_clip), rtol=1e-9) and torch.equal(row_none, err_none)
    assert (row_err <= err * (1 + 1e-12)).all() and row_err.sum() < 0.97 * err.sum()  # 6% here
    for gi in range(4):  # converged: no single group's other candidate lowers a row's error
        for r in ratios:
            c = row_clip.clone()
            c[:, gi] = unclipped[:, gi] * r
            assert (row_errors(c) >= row_err * (1 - 1e-9)).all()


def test_layer_clip_losses_and_skipped_linears():
    result = search_layer(_layer(GQA), GQA, _x(), AwqConfig(group_size=G, n_grid=4))
    assert set(result.clips) == {"wv", "wo", "w_gate", "w_up", "w_down"}  # q and k never clipped
    assert result.clips["w_down"].shape == (64, 128 // G)
    for attr in result.clips:
        assert result.losses[f"clip.{attr}"] <= result.losses[f"clip.{attr}.none"]


def test_clip_losses_are_the_packed_checkpoints_errors():
    """The clip search judges the weights the checkpoint will hold: steps rounded to fp16, the packer's codes."""
    layer, x = _layer(GQA), _x()
    for fp16 in (True, False):
        result = search_layer(layer, GQA, x, AwqConfig(group_size=G, n_grid=4, fp16_steps=fp16))
        scaled = apply_awq(layer, AwqLayerResult(scales=result.scales), GQA)  # scales folded, nothing clipped
        seen = {}
        _fwd(scaled, GQA, x, observer=lambda p, a: seen.__setitem__(p, a))
        final = apply_awq(layer, result, GQA)
        errs = {}
        for attr, point in CLIP_INPUTS.items():
            packed = AwqLinear.from_dense(getattr(final, attr).dense_weight(), G).dense_weight()  # [N, K]
            errs[attr] = float((seen[point] @ (packed - getattr(scaled, attr).dense_weight()).T).pow(2).mean())
        if fp16:
            assert errs == pytest.approx({a: result.losses[f"clip.{a}"] for a in errs}, rel=1e-4)
        else:  # fp32 steps: the search saw slightly different weights than the checkpoint holds
            assert errs != pytest.approx({a: result.losses[f"clip.{a}"] for a in errs}, rel=1e-4)


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
        a, b = apply_awq(layer, r, MHA), apply_awq(layer, r2, MHA)
        for attr, _ in LINEAR_NAMES:
            assert torch.equal(getattr(a, attr).dense_weight(), getattr(b, attr).dense_weight())
        assert torch.equal(a.attn_norm, b.attn_norm) and torch.equal(a.ffn_norm, b.ffn_norm)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CorruptCheckpointError):
        load_awq_results(bad)


def test_results_file_follows_the_output_rules(tmp_path):
    """No overwrite without force; the temporary is fllama's (hidden, owned), so a killed writer's is removed by the
    next save; a v2 file (before the row clip objective) still loads, as searched by groups."""
    path = tmp_path / "awq.safetensors"
    results, cfg = [AwqLayerResult(scales={"qkv": torch.ones(64)})], AwqConfig(group_size=G)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / (temp_prefix(path, pid=proc.pid) + "abc.tmp")  # left by a run that was killed
    stale.write_bytes(b"half written")
    save_awq_results(path, results, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["awq.safetensors"]
    with pytest.raises(FllamaError, match="--force"):
        save_awq_results(path, results, cfg)
    save_awq_results(path, results, dataclasses.replace(cfg, clip_objective="group"), force=True)
    assert load_awq_results(path).config.clip_objective is ClipObjective.GROUP
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(path), framework="pt") as f:
        info = json.loads(f.metadata()["fllama"])
    info["version"], info["awq"] = 2, {k: v for k, v in info["awq"].items() if k != "clip_objective"}
    save_file({"layers.0.scales.qkv": torch.ones(64)}, str(tmp_path / "v2.safetensors"),
              metadata={"fllama": json.dumps(info)})
    assert load_awq_results(tmp_path / "v2.safetensors").config.clip_objective is ClipObjective.GROUP


def test_search_uses_the_first_samples_holding_search_tokens():
    layer, x = _layer(GQA), _x(batch=4, seq=32)
    cfg = AwqConfig(group_size=G, n_grid=4, search_tokens=40)  # 40 tokens -> the first 2 samples of 32
    a, b = search_layer(layer, GQA, x, cfg), search_layer(layer, GQA, x[:2], cfg)
    assert a.losses == b.losses and all(torch.equal(a.scales[k], b.scales[k]) for k in a.scales)
    c = search_layer(layer, GQA, x[:1], cfg)
    assert c.losses != a.losses


# --- duo scaling and AutoAWQ's own search ---------------------------------------------------------


def test_duo_scales_and_weight_mean_known_answer():
    x_mean = torch.tensor([4.0, 1.0, 0.25])
    w_mean = torch.tensor([0.5, 0.5, 0.125])
    s = awq_scales(x_mean, 0.5, w_mean)
    raw = x_mean.sqrt() / (w_mean.sqrt() + 1e-4)  # AutoAWQ: x^a / (w^(1-a) + 1e-4), then max * min = 1
    assert torch.allclose(s, raw / (raw.max() * raw.min()).sqrt())
    assert torch.allclose(awq_scales(x_mean, 1.0), x_mean / 1.0)  # x^1 / sqrt(4 * 0.25) = x
    # w_mean: mean over rows (of all the group's linears) of |w| / max |w| of its quantization group
    ws = {"a": torch.tensor([[1.0, -2.0, 0.5, 0.5]]), "b": torch.tensor([[4.0, 4.0, -1.0, 0.0]])}
    wm = weight_mean(ws, ScaleGroup("x", ("a", "b"), "n"), 2)
    assert torch.allclose(wm, torch.tensor([0.75, 1.0, 1.0, 0.5]), atol=1e-5)


def _autoawq_quantizer():
    """AutoAWQ 0.2.9's AwqQuantizer class, its module executed alone with its package's heavy imports stubbed
    (the search methods use torch only); sys.modules is restored afterwards."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "quantize" / "quantizer.py"
    names = ("transformers", "tqdm", "awq", "awq.utils", "awq.utils.calib_data", "awq.utils.utils", "awq.utils.module",
             "awq.quantize", "awq.quantize.scale", "awq.modules", "awq.modules.linear")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        stub = types.ModuleType(n)
        stub.__getattr__ = lambda attr: (lambda *a, **k: None)  # every imported name: a no-op function
        sys.modules[n] = stub
    try:
        loader = importlib.util.spec_from_file_location("_autoawq_quantizer", path)
        mod = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(mod)
    finally:
        for n, m in saved.items():
            sys.modules.pop(n) if m is None else sys.modules.__setitem__(n, m)
    q = object.__new__(mod.AwqQuantizer)
    q.w_bit, q.group_size, q.zero_point, q.duo_scaling = 4, G, True, True
    q.max_chunk_memory, q.n_parallel_calib_samples = 1 << 30, None
    return q


def _copying_state_dict(module):
    """AutoAWQ keeps a module's "original" weights as state_dict().cpu(), which on a CPU aliases the parameters
    that its first candidate then scales in place; it keeps a copy on a GPU, as here."""
    own = module.state_dict
    module.state_dict = lambda *a, **k: {n: t.clone() for n, t in own(*a, **k).items()}
    return module


class _Mlp(torch.nn.Module):
    def __init__(self, ws):
        super().__init__()
        for attr in ("w_gate", "w_up", "w_down"):
            lin = torch.nn.Linear(ws[attr].shape[1], ws[attr].shape[0], bias=False)
            lin.weight.data = ws[attr].clone()
            setattr(self, attr, _copying_state_dict(lin))
        _copying_state_dict(self)

    def forward(self, h):
        return self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


def test_scale_and_clip_searches_match_autoawq():
    """AutoAWQ's own _search_best_scale (duo scaling, its grid and loss) on the MLP and on down_proj alone,
    and its _compute_best_clip, give fllama's scales and clips."""
    q = _autoawq_quantizer()
    # AutoAWQ's token sample, per-group clip objective and (in fp32, on a CPU) fp32 steps
    layer, cfg = _layer(GQA), AwqConfig(group_size=G, clip_tokens=512, clip_objective="group", fp16_steps=False)
    seen = {}
    _fwd(layer, GQA, _x(), observer=lambda p, a: seen.__setitem__(p, a))
    ws = working_weights(layer, torch.float32)
    mlp = _Mlp(ws)
    groups = {g.name: g for g in SCALE_GROUPS}
    for name, linears, module in (("gate_up", [mlp.w_gate, mlp.w_up], mlp), ("down", [mlp.w_down], None)):
        *_, theirs = q._search_best_scale(mlp, None, linears, seen[name], module2inspect=module)
        ours, alpha, *_ = search_scale(ws, groups[name], seen[name], loss_fn(name, GQA, seen[name], ws), cfg,
                                       TiedColumns())
        assert alpha is not None and torch.allclose(ours, theirs, rtol=1e-5), name
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))  # [N, K]: AutoAWQ takes N % 64 == 0
    x = seen["down"]  # [T, 128]
    ours, _, _ = search_clip(w, x, cfg)
    assert torch.equal(ours, q._compute_best_clip(w, x).reshape(ours.shape))


# --- v_proj -> o_proj scaling under GQA -----------------------------------------------------------


def test_tied_columns_reduce_and_expand():
    tie = tied_columns(SCALE_GROUPS[1], GQA)  # 4 query heads, 2 KV heads, head_dim 16
    assert (tie.copies, tie.block) == (2, 16) and tied_columns(SCALE_GROUPS[1], MHA).copies == 1
    s = torch.arange(32.0)  # one per v_proj row: KV head j, dim d at j * 16 + d
    cols = tie.expand(s)  # query head h reads KV head h // 2
    assert torch.equal(cols.view(4, 16), torch.stack([s[:16], s[:16], s[16:], s[16:]]))
    assert torch.equal(tie.reduce(cols), s)  # the mean of tied copies
    assert torch.equal(tie.reduce(torch.cat([torch.zeros(16), torch.full((16,), 2.0), torch.ones(32)])),
                       torch.cat([torch.ones(16), torch.ones(16)]))


def test_gqa_v_to_o_scaling_preserves_the_model():
    """Scales on v_proj's rows, shared by o_proj's columns of every query head of that KV head, are an exact
    transform before quantization: the whole model's logits do not move (fp32)."""
    config = LlamaConfig(64, 2, 4, 2, 128, 300, name="tiny-gqa2")
    weights = ModelWeights.from_state_dict(config, random_state_dict(config, seed=3))
    g = torch.Generator().manual_seed(4)
    scaled = [apply_awq(l, AwqLayerResult(scales={"o": torch.rand(config.kv_size, generator=g) * 4 + 0.1}), config)
              for l in weights.layers]
    for before, after in zip(weights.layers, scaled):
        assert not torch.equal(before.wv.dense_weight(), after.wv.dense_weight())
        ratio = (after.wo.dense_weight() / before.wo.dense_weight()).view(64, 4, 16)  # [H, heads, d]
        assert torch.allclose(ratio[:, 0], ratio[:, 1]) and torch.allclose(ratio[:, 2], ratio[:, 3])
    tokens = torch.randint(0, 300, (2, 24), generator=g)  # [B, S]
    want = ReferenceModel(weights).forward(tokens)
    got = ReferenceModel(dataclasses.replace(weights, layers=scaled)).forward(tokens)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_o_scales_are_searched_and_optional():
    layer, x = _layer(GQA), _x()
    on = AwqConfig(group_size=G, clip=False, gqa_o_scaling=True)
    result = search_layer(layer, GQA, x, on)
    assert result.scales["o"].shape == (GQA.kv_size,)
    assert result.losses["o"] <= result.losses["o.rtn"]
    off = search_layer(layer, GQA, x, AwqConfig(group_size=G, clip=False))  # the default under GQA
    assert off.scales.keys() == {"qkv", "gate_up", "down"}
    assert "o" in search_layer(_layer(MHA), MHA, x, AwqConfig(group_size=G, clip=False)).scales  # MHA: always
    again = search_layer(layer, GQA, x, on)  # deterministic
    assert again.losses == result.losses and all(torch.equal(again.scales[k], result.scales[k]) for k in result.scales)


# --- what the next layer is searched on -----------------------------------------------------------


def test_layer_input_choices():
    config = LlamaConfig(64, 2, 4, 2, 128, 300, name="tiny-gqa2")
    weights = ModelWeights.from_state_dict(config, random_state_dict(config, seed=5))
    windows = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(6))  # [n, L]
    qcfg = QuantConfig(scheme=Scheme.AWQ, group_size=G)

    def second_layer_losses(choice):
        _, report = quantize_awq(weights, qcfg, windows, CaptureConfig(batch=2), AwqConfig(layer_input=choice))
        return report["layers"][1]["losses"]

    # FLOAT: the next layer is searched on the original model's hidden states
    h0 = weights.embed[windows]  # [n, L, H]
    want = search_layer(weights.layers[1], config, _fwd(weights.layers[0], config, h0), AwqConfig(group_size=G))
    assert second_layer_losses(LayerInput.FLOAT) == pytest.approx(want.losses, rel=1e-4)
    assert second_layer_losses(LayerInput.QUANTIZED) != second_layer_losses(LayerInput.SCALED)
    assert AwqConfig(layer_input="quantized").layer_input is LayerInput.QUANTIZED  # as read back from JSON
