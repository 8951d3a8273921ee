"""The KV cache's kinds on CPU: the fp8 (e4m3) codes' numerics, the references the GPU tests compare with, the bytes
a cache takes, and the --kv-int8 / --kv-fp8 options (EngineConfig, the CLI's one-line refusals)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels_cu.attention_decode import attention_decode_ref, dequantize_cache
from kernels_cu.attention_prefill import attention_prefill_ref
from kernels_cu.engine.cache import kv_position_bytes
from kernels_cu.engine.config import EngineConfig
from kernels_cu.kv_codes import SUFFIX, KvKind, quantize_kv_ref
from kernels_cu.rope_kv import ENTRIES, write_kv_ref
from model_zoo.config import LlamaConfig
from model_zoo.errors import ConfigError
from model_zoo.quant.fp8 import quantize_act_fp8_per_token
from tests.test_cli import assert_one_line_error, fllama

KERNELS = Path(__file__).resolve().parents[1] / "kernels_cu"
# the CLI cases need a checkpoint only to get past the argument parser; each is refused before it loads
CFG = LlamaConfig(hidden_size=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_size=96, vocab_size=512,
                  max_positions=128, name="kv-tiny")


def head_vectors(n: int, d: int, seed: int) -> torch.Tensor:
    """fp16 head vectors [n, d] whose maxima span six orders of magnitude, one all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[0] = 0.0
    return x.half()  # [n, d]


def test_fp8_codes_are_model_zoo_per_token_rule():
    """Each head vector quantized as a token by model_zoo.quant.fp8 (scale = amax / 448, codes by torch's cast):
    the same codes and scales, bit for bit."""
    x = head_vectors(64, 128, seed=1)
    codes, scale = quantize_kv_ref(x, KvKind.FP8)
    want_codes, want_scale = quantize_act_fp8_per_token(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scale, want_scale)


def test_fp8_codes_known_answers():
    """The largest |x| of a vector becomes +-448 exactly; every value round-trips within half an e4m3 step
    (2^-4 relative for normals, 2^-10 absolute in code units below 2^-6); a zero vector gives zero codes and the
    1e-8 / 448 scale; no code is NaN."""
    x = head_vectors(32, 64, seed=2)
    codes, scale = quantize_kv_ref(x, KvKind.FP8)
    c = codes.float()
    assert not torch.isnan(c).any()
    assert torch.equal(c[1:].abs().amax(dim=1), torch.full((31,), 448.0))
    assert torch.equal(c[0], torch.zeros(64)) and scale[0] == torch.tensor(1e-8) / 448
    exact = x.float() / scale[:, None]  # code units
    assert bool(((c - exact).abs() <= torch.maximum(exact.abs() * 2.0**-4, torch.tensor(2.0**-10))).all())
    assert torch.equal(quantize_kv_ref(torch.tensor([[1.0, 3.0, -448.0, 0.25]]), KvKind.FP8)[0].float(),
                       torch.tensor([[1.0, 3.0, -448.0, 0.25]]))


def test_int8_codes_keep_their_rule():
    x = head_vectors(16, 64, seed=3)
    codes, scale = quantize_kv_ref(x, KvKind.INT8)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert torch.allclose(dequantize_cache(codes, scale), x.float(), atol=float(scale.max()) * 0.5001, rtol=0)
    with pytest.raises(ValueError, match="values"):
        quantize_kv_ref(x, KvKind.FP16)


def test_write_kv_ref_stores_fp8_codes_at_row_and_position():
    B, n_kv, L, d, T = 3, 2, 10, 32, 4
    kc = torch.zeros(B, n_kv, L, d, dtype=torch.float8_e4m3fn)
    vc, ks, vs = torch.zeros_like(kc), torch.zeros(B, n_kv, L), torch.zeros(B, n_kv, L)
    k, v = head_vectors(T * n_kv, d, 4).view(T, n_kv, d), head_vectors(T * n_kv, d, 5).view(T, n_kv, d)
    pos, row = torch.tensor([0, 9, 3, 3], dtype=torch.int32), torch.tensor([2, 0, 0, 1], dtype=torch.int32)
    write_kv_ref(kc, vc, k, v, pos, row, ks, vs)
    for t in range(T):
        r, p = int(row[t]), int(pos[t])
        for cache, scale, src in ((kc, ks, k), (vc, vs, v)):
            codes, s = quantize_kv_ref(src[t], KvKind.FP8)
            assert torch.equal(cache[r, :, p].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(scale[r, :, p], s)
    assert int((ks != 0).sum()) == int((vs != 0).sum()) == T * n_kv  # only the written slots (a zero vector too)


@pytest.mark.parametrize("kind", [KvKind.INT8, KvKind.FP8])
def test_attention_references_on_8bit_caches(kind):
    """The decode and prefill references read an 8-bit cache as code * scale: near attention over the fp16 K/V the
    codes came from (e4m3's 3 mantissa bits give ~2% per value), GQA 3, ragged odd lengths."""
    B, H, Hkv, L, D = 3, 9, 3, 37, 64
    g = torch.Generator().manual_seed(6)
    k16, v16 = (torch.randn(B, Hkv, L, D, generator=g).half() for _ in range(2))  # [B, Hkv, L, D]
    kc, ks = quantize_kv_ref(k16.view(-1, D), kind)
    vc, vs = quantize_kv_ref(v16.view(-1, D), kind)
    kc, vc, ks, vs = kc.view(B, Hkv, L, D), vc.view(B, Hkv, L, D), ks.view(B, Hkv, L), vs.view(B, Hkv, L)
    q = torch.randn(B, H, D, generator=g).half()  # [B, H, D]
    lengths = torch.tensor([1, 37, 19], dtype=torch.int32)
    got = attention_decode_ref(q, kc, vc, lengths, ks, vs).float()
    want = attention_decode_ref(q, k16, v16, lengths).float()
    assert float((got - want).norm() / want.norm()) < (0.05 if kind is KvKind.FP8 else 0.01)
    qp = torch.randn(5, H, D, generator=g).half()  # [S, H, D]
    got = attention_prefill_ref(qp, kc, vc, row=1, start=30, k_scale=ks, v_scale=vs).float()
    want = attention_prefill_ref(qp, k16, v16, row=1, start=30).float()
    assert float((got - want).norm() / want.norm()) < (0.05 if kind is KvKind.FP8 else 0.01)


def test_kinds_bytes_and_kernel_entries():
    """fp8 and int8 take a byte a value plus an fp32 scale per head vector; every kind's kernels exist."""
    c = LlamaConfig.from_name("llama2-7b")
    assert kv_position_bytes(c, KvKind.FP16) == 2 * 32 * 32 * 128 * 2
    assert kv_position_bytes(c, KvKind.FP8) == kv_position_bytes(c, KvKind.INT8) == 2 * 32 * 32 * (128 + 4)
    assert [KvKind.of(torch.empty(0, dtype=k.dtype)) for k in KvKind] == list(KvKind)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        KvKind.of(torch.empty(0, dtype=torch.bfloat16))
    for src, names in (("rope_kv.cu", ENTRIES.values()),
                       *((f"attention_{p}.cu", [f"attn_{p}_d{d}{SUFFIX[k]}" for d in (64, 128) for k in KvKind])
                         for p in ("decode", "fused"))):
        text = (KERNELS / src).read_text()
        for name in names:
            assert re.search(rf"\b{name}\b", text), f"{src} has no entry {name}"


def test_engine_config_takes_one_kv_kind():
    assert EngineConfig().kv is KvKind.FP16
    assert EngineConfig(kv="fp8").kv is KvKind.FP8 and EngineConfig(kv=KvKind.INT8).kv is KvKind.INT8
    with pytest.raises(ConfigError, match="fp16, int8, fp8"):
        EngineConfig(kv="fp4")


@pytest.mark.parametrize("cmd", [["generate", "{model}", "-p", "x"], ["chat", "{model}"], ["eval", "{model}"],
                                 ["bench", "--random", "--model", "llama2-7b"],
                                 ["serve", "{model}", "--port", "18763"]])
def test_both_kv_options_are_refused_in_one_line(capsys, monkeypatch, model_dir, cmd):
    args = [str(model_dir) if a == "{model}" else a for a in cmd]
    code, _, err = fllama(capsys, monkeypatch, *args, "--kv-int8", "--kv-fp8", stdin="")
    assert_one_line_error(code, err, "--kv-int8 and --kv-fp8")


@pytest.mark.parametrize("opt", ["--kv-int8", "--kv-fp8"])
def test_kv_options_need_the_gpu_engine(capsys, monkeypatch, model_dir, opt):
    code, _, err = fllama(capsys, monkeypatch, "generate", model_dir, "-p", "x", "--device", "cpu", opt)
    assert_one_line_error(code, err, f"{opt} is an option of the GPU engine")


@pytest.mark.parametrize("cmd", ["generate", "chat", "eval", "serve", "bench"])
def test_help_offers_both_kv_options(capsys, monkeypatch, cmd):
    code, out, _ = fllama(capsys, monkeypatch, cmd, "--help")
    assert code == 0 and "--kv-fp8" in out and "--kv-int8" in out


def test_fp8_cache_on_a_gpu_without_e4m3_is_one_line(monkeypatch):
    """Compute capability < 8.9 (an A100 here, faked): one DeviceError line naming the GPU and the way out; int8 and
    fp16 caches are not affected."""
    import kernels_cu.kv_codes as kv_codes
    from model_zoo.errors import DeviceError

    monkeypatch.setattr(kv_codes, "has_fp8", lambda device_index: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device_index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device_index=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(DeviceError) as e:
        kv_codes.require_kind(KvKind.FP8, 0)
    assert "\n" not in str(e.value) and "8.9" in str(e.value) and "A100" in str(e.value) and "--kv-int8" in str(e.value)
    kv_codes.require_kind(KvKind.INT8, 0)
    kv_codes.require_kind(KvKind.FP16, 0)
