"""GPTQ int4 checkpoints: packed here from the published layout (and by AutoGPTQ's own packer where it is
installed), loaded by fllama onto the AWQ int4 layout, and compared with their dense dequantized weights.

Layout (AutoGPTQ / GPTQModel): qweight int32 [K/8, N] packed along K (nibble i of word r = row 8r + i), qzeros
int32 [K/G, N/8] packed along N (nibble j of word c = column 8c + j), scales fp16 [K/G, N], g_idx int32 [K];
w = (q - z) * s; format v1 stores z - 1, v2 stores z.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_zoo.config import LlamaConfig
from model_zoo.errors import DeviceError, ModelSourceError
from model_zoo.generation import GenerationConfig, generate
from model_zoo.load import load_model
from model_zoo.quant.checkpoint import build_weights, describe_model
from model_zoo.quant.gptq import ActOrderLinear, GptqLayout, gptq_linear
from model_zoo.quant.linear import AwqLinear
from model_zoo.reference import ReferenceModel
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import LINEAR_NAMES, ModelWeights, random_state_dict
from tests.helpers import EosTokenizer

CFG = LlamaConfig(64, 2, 4, 2, 128, 300, rope_theta=10000.0, max_positions=256, name="gptq-tiny")


def to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_pack(w: torch.Tensor, G: int, sym: bool, act_order: bool, v2: bool, seed: int = 0):
    """W [N, K] -> (GPTQ tensors, W_hat [N, K] fp32 that they encode), written from the published layout.

    GPTQ's quantizer: per column and group, xmin = min(w, 0), xmax = max(w, 0) (sym: +-max|w|), s = range / 15,
    z = round(-xmin / s) (sym: 8), q = clamp(round(w / s) + z, 0, 15). Act-order quantizes the input rows in a
    permuted order; g_idx gives each row's group."""
    n, k = w.shape
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    wp = w.float()[:, perm].reshape(n, k // G, G)  # [N, K/G, G] in quantization order
    xmin, xmax = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)  # [N, K/G]
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    s = ((xmax - xmin) / 15).half()  # [N, K/G] as stored
    z = torch.full_like(xmin, 8.0) if sym else torch.round(-xmin / s.float())  # [N, K/G]
    q = (torch.round(wp / s.float()[..., None]) + z[..., None]).clamp(0, 15)  # [N, K/G, G]
    w_hat_p = ((q - z[..., None]) * s.float()[..., None]).reshape(n, k)
    q_rows = torch.empty(k, n, dtype=torch.int64)
    q_rows[perm] = q.reshape(n, k).T.long()  # [K, N] in the model's input order
    w_hat = torch.empty(n, k)
    w_hat[:, perm] = w_hat_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // G).int()
    qweight = sum(q_rows[i::8] << (4 * i) for i in range(8))  # [K/8, N]: row 8r + i in nibble i
    stored = z.T.long() - (0 if v2 else 1)  # [K/G, N]
    assert int(stored.min()) >= 0, "a v1 pack cannot store a zero point of 0"
    qzeros = sum(stored[:, j::8] << (4 * j) for j in range(8))  # [K/G, N/8]: column 8c + j in nibble j
    tensors = {"qweight": to_int32(qweight).contiguous(), "qzeros": to_int32(qzeros).contiguous(),
               "scales": s.T.contiguous(), "g_idx": g_idx}
    return tensors, w_hat


@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_one_linear_equals_its_dequantized_weight(G, sym, v2, act_order):
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(G)) * 0.1  # [N, K]
    t, w_hat = gptq_pack(w, G, sym, act_order, v2, seed=G)
    lin = gptq_linear("m", {f"m.{k}": v for k, v in t.items()}, GptqLayout(G, sym, act_order, 0 if v2 else 1))
    assert isinstance(lin, ActOrderLinear if act_order else AwqLinear)
    assert torch.equal(lin.dense_weight(), w_hat.half())  # fp16 scales times integers, rounded once
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(lin(x), x @ w_hat.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("auto_gptq") is None, reason="auto-gptq is not installed")
@pytest.mark.parametrize("sym", [True, False])
def test_autogptq_own_packer_and_dequantizer_agree(sym):
    """AutoGPTQ's QuantLinear.pack (format v1, zeros minus one) and its torch forward, loaded from its source file
    without its CUDA extensions."""
    path = Path(importlib.util.find_spec("auto_gptq").submodule_search_locations[0]) / "nn_modules" / "qlinear" / \
        "qlinear_cuda_old.py"
    spec = importlib.util.spec_from_file_location("autogptq_qlinear_cuda_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    K, N, G = 256, 64, 64
    lin = torch.nn.Linear(K, N, bias=False).half()
    torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(3))
    wg = lin.weight.detach().float().reshape(N, K // G, G)
    xmin, xmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    scale = (xmax - xmin) / 15
    zero = torch.full_like(scale, 8.0) if sym else torch.round(-xmin / scale)
    ql = mod.QuantLinear(4, G, K, N, False)
    ql.pack(lin, scale.half(), zero, torch.arange(K, dtype=torch.int32) // G)  # scales/zeros [N, K/G]
    theirs = ql.forward(torch.eye(K, dtype=torch.float16)).float().T  # [N, K]: their own dequantized weight
    sd = {"m.qweight": ql.qweight, "m.qzeros": ql.qzeros, "m.scales": ql.scales, "m.g_idx": ql.g_idx}
    ours = gptq_linear("m", sd, GptqLayout(G, sym, False, 1)).dense_weight()  # fp16
    assert torch.equal(ours.float(), theirs)


def write_gptq_dir(d: Path, *, G: int = 32, sym: bool = True, act_order: bool = False, v2: bool = False,
                   config_changes: dict | None = None, extra: dict | None = None,
                   config: LlamaConfig = CFG) -> dict[str, torch.Tensor]:
    """An HF directory of `config` as a GPTQ checkpoint; returns the dense state dict of the weights it encodes."""
    d.mkdir(parents=True, exist_ok=True)
    sd, dense = random_state_dict(config, seed=0), {}
    out = {k: v.half() for k, v in sd.items() if "_proj" not in k}
    for i in range(config.n_layers):
        for _, path in LINEAR_NAMES:
            p = f"model.layers.{i}.{path}"
            t, w_hat = gptq_pack(sd[p + ".weight"], G, sym, act_order, v2, seed=i)
            out.update({f"{p}.{k}": v for k, v in t.items()})
            dense[p + ".weight"] = w_hat
    out.update(extra or {})
    save_file(out, str(d / "model.safetensors"))
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": act_order, "sym": sym,
          "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    cfg = {**config.to_hf(), "quantization_config": {**qc, **(config_changes or {})}}
    (d / "config.json").write_text(json.dumps(cfg))
    Tokenizer.byte_fallback(config.vocab_size).save(d)
    return {**{k: v.half().float() for k, v in sd.items() if "_proj" not in k}, **dense}


@pytest.mark.parametrize("act_order", [False, True])
def test_checkpoint_runs_as_its_dense_dequantized_model(tmp_path, act_order):
    dense_sd = write_gptq_dir(tmp_path / "q", act_order=act_order, sym=act_order)
    loaded = load_model(tmp_path / "q")
    quant = ReferenceModel(build_weights(loaded, torch.float32))
    dense = ReferenceModel(ModelWeights.from_state_dict(CFG, dense_sd))  # fp32: (q - z) * s exactly
    ids = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    want = dense.forward(ids)
    assert float((quant.forward(ids) - want).norm() / want.norm()) < 1e-6
    tok = EosTokenizer(loaded.tokenizer, set())
    cfg = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=0.0))
    prompts = [ids[0, :12].tolist()]
    assert generate(quant, tok, prompts, cfg)[0][0].tokens == generate(dense, tok, prompts, cfg)[0][0].tokens


def test_info_describes_gptq(tmp_path):
    write_gptq_dir(tmp_path / "q", G=64, sym=False, v2=True)
    info = describe_model(str(tmp_path / "q"))
    assert info["scheme"] == "awq" and info["quant_format"] == "gptq_v2 (group 64, asym, desc_act False)"
    assert info["group_size"] == 64


def test_zero_biases_are_exact_and_nonzero_ones_refused(tmp_path):
    from model_zoo.errors import UnsupportedArchitectureError

    bias = "model.layers.0.mlp.down_proj.bias"
    write_gptq_dir(tmp_path / "z", extra={bias: torch.zeros(64, dtype=torch.float16)})
    load_model(tmp_path / "z")  # old GPTQ packers store zero biases for bias-free layers
    write_gptq_dir(tmp_path / "nz", extra={bias: torch.ones(64, dtype=torch.float16)})
    with pytest.raises(UnsupportedArchitectureError, match=bias):
        load_model(tmp_path / "nz")


@pytest.mark.parametrize("changes,needle", [
    ({"bits": 8}, "8 bits"),
    ({"group_size": 256}, "group_size 256"),
    ({"group_size": -1}, "group_size -1"),
    ({"checkpoint_format": "marlin"}, "'marlin'"),
    ({"lm_head": True}, "lm_head"),
    ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
])
def test_unsupported_gptq_configs_are_refused_in_one_line(tmp_path, changes, needle):
    write_gptq_dir(tmp_path / "q", config_changes=changes)
    with pytest.raises(ModelSourceError, match=needle):
        load_model(tmp_path / "q")


def test_a_v1_zero_point_of_16_is_refused():
    t, _ = gptq_pack(torch.randn(8, 64) * 0.1, 32, True, False, v2=False)
    t["qzeros"][0, 0] = to_int32(torch.tensor(0x777777F7))  # column 1 of group 0 stores 15: z = 16 in v1
    with pytest.raises(ModelSourceError, match="zero point 16"):
        gptq_linear("m", {f"m.{k}": v for k, v in t.items()}, GptqLayout(32, True, False, 1))


def test_the_gpu_engine_refuses_act_order_in_one_line():
    from kernels_cu.engine.linears import fuse

    t, _ = gptq_pack(torch.randn(64, 64) * 0.1, 32, True, True, v2=False)
    lin = gptq_linear("m", {f"m.{k}": v for k, v in t.items()}, GptqLayout(32, True, True, 1))
    with pytest.raises(DeviceError, match="act-order GPTQ"):
        fuse([lin, lin], torch.device("cpu"))
