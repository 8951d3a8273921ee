"""AWQ int4 (AutoAWQ GEMM layout): known answers, packing against independent code and AutoAWQ's own."""

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_zoo.errors import ConfigError
from model_zoo.quant.awq_pack import (AWQ_ORDER, AWQ_REVERSE_ORDER, dequantize_awq, fake_quantize_awq, pack_awq,
                                      quantize_awq, quantize_awq_rtn, unpack_awq)
from model_zoo.quant.formats import Scheme, awq_quantization_config, export_tensors_awq, linear_factory_for
from model_zoo.quant.linear import AwqLinear

# --- an independent reader/writer of the published layout (REFERENCE.md section 2), numpy and shifts ---------
# Nibble i (bits 4i..4i+3) of word c holds column 8c + PUBLISHED_ORDER[i].
PUBLISHED_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def np_unpack(words: np.ndarray) -> np.ndarray:
    u = words.astype(np.int32).view(np.uint32)
    rows, n_words = u.shape
    out = np.empty((rows, n_words * 8), dtype=np.int64)
    for i, col in enumerate(PUBLISHED_ORDER):
        out[:, col::8] = (u >> np.uint32(4 * i)) & np.uint32(0xF)  # scatter nibble i to its column
    return out


def np_pack(codes: np.ndarray) -> np.ndarray:
    rows, n = codes.shape
    u = np.zeros((rows, n // 8), dtype=np.uint32)
    for i, col in enumerate(PUBLISHED_ORDER):
        u |= codes[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return u.view(np.int32)


def np_dequant(q: np.ndarray, z: np.ndarray, s: np.ndarray, g: int) -> np.ndarray:
    """[K, N] codes, [K/G, N] zeros and fp16 scales -> fp16 W [N, K]; numpy's fp16 product is correctly rounded."""
    diff = (q - np.repeat(z, g, axis=0)).astype(np.float16)
    return (diff * np.repeat(s, g, axis=0)).T


# --- known answers --------------------------------------------------------------------------------------------

def test_orders_are_inverse_permutations():
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7) and AWQ_REVERSE_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)
    assert [AWQ_ORDER[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


def test_rtn_known_group():
    # one output row, K = 8, G = 4: group 0 spans [-1, 2], group 1 is all positive ([1, 4])
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0, 1.0, 2.0, 3.0, 4.0]] * 8)  # N = 8 identical rows
    q, zeros, scales = quantize_awq_rtn(w, group_size=4)
    assert q.shape == (8, 8) and zeros.shape == (2, 8) and scales.shape == (2, 8)
    assert scales.dtype == torch.float16 and q.dtype == torch.uint8
    s = torch.tensor(0.2, dtype=torch.float16)  # (2 - -1) / 15 and (4 - 1) / 15
    assert torch.equal(scales, torch.full((2, 8), 0.2, dtype=torch.float16))
    # group 0: z = -round(-1 / s) = 5; q = round(w / s) + 5 = [0, 5, 8 (2.5006 -> 3), 15]
    assert zeros[0].tolist() == [5] * 8 and q[:4, 0].tolist() == [0, 5, 8, 15]
    # group 1: -round(1 / s) = -5 clamps to 0, and 4 / s = 20 clamps to 15 (AutoAWQ's formula loses it)
    assert zeros[1].tolist() == [0] * 8 and q[4:, 0].tolist() == [5, 10, 15, 15]
    w_hat = dequantize_awq(pack_awq(q), pack_awq(zeros), scales, 4, torch.float16)
    want = torch.tensor([-5, 0, 3, 10, 5, 10, 15, 15], dtype=torch.float16) * s
    assert torch.equal(w_hat[0], want)


def test_clip_max_clamps_each_group_first():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]] * 8)
    q, zeros, scales = quantize_awq_rtn(w, 4, clip_max=torch.full((8, 1), 1.0))
    # clamped to [-1, 1]: s = 2 / 15, z = round(7.5) = 8 (half to even), 2.0 -> 1.0 -> 7.5 + 8 -> 16 -> 15
    assert scales[0, 0].item() == torch.tensor(2 / 15, dtype=torch.float16).item()
    assert zeros[0, 0].item() == 8 and q[:, 0].tolist() == [0, 8, 12, 15]


def test_pack_known_words():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7],  # column c holds c
                      [0, 0, 0, 0, 0, 0, 0, 15],  # column 7 -> nibble 7, the sign bit
                      [9, 0, 0, 0, 0, 0, 0, 0]])
    words = pack_awq(q)
    assert words.dtype == torch.int32
    assert words[:, 0].tolist() == [0x75316420, 0xF0000000 - 2**32, 9]
    assert torch.equal(unpack_awq(words), q.to(torch.uint8))


def test_pack_unpack_round_trip_and_errors():
    q = torch.randint(0, 16, (12, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_awq(pack_awq(q)).long(), q)
    with pytest.raises(ConfigError, match="multiple of 8"):
        pack_awq(torch.zeros(2, 12, dtype=torch.int64))
    with pytest.raises(ConfigError, match="0..15"):
        pack_awq(torch.full((1, 8), 16))


def test_group_size_error_names_the_sizes_that_work():
    w = torch.zeros(16, 576)
    with pytest.raises(ConfigError, match=r"does not divide the input size 576; use one of 32, 64, 192"):
        quantize_awq_rtn(w, 128)
    with pytest.raises(ConfigError, match="multiple of 8"):
        quantize_awq_rtn(torch.zeros(12, 64), 32)


def test_rtn_error_bound_and_fake_quant_matches_checkpoint():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)).half()
    qweight, qzeros, scales = quantize_awq(w, 64)
    w_hat = dequantize_awq(qweight, qzeros, scales, 64, torch.float16)
    assert w_hat.shape == (32, 256)
    step = scales.float().T.repeat_interleave(64, dim=1)  # [N, K]
    assert ((w_hat.float() - w.float()).abs() <= 0.5 * step * 1.01 + 1e-3).all()
    assert torch.equal(fake_quantize_awq(w, 64), w_hat)


# --- the published layout, read and written by independent code ---------------------------------------------

def test_export_read_by_independent_unpacker():
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(2)).half()
    q, zeros, scales = quantize_awq_rtn(w, 32)
    qweight, qzeros, _ = quantize_awq(w, 32)
    assert np.array_equal(np_unpack(qweight.numpy()), q.numpy())
    assert np.array_equal(np_unpack(qzeros.numpy()), zeros.numpy())
    assert np.array_equal(np_pack(q.numpy().astype(np.int64)), qweight.numpy())
    want = np_dequant(q.numpy().astype(np.int64), zeros.numpy().astype(np.int64), scales.numpy(), 32)
    assert np.array_equal(dequantize_awq(qweight, qzeros, scales, 32).numpy(), want)


def test_independently_packed_checkpoint_loads_and_runs():
    k, n, g = 192, 48, 64
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    s = (rng.random((k // g, n)) * 0.02 + 0.001).astype(np.float16)
    prefix = "model.layers.0.mlp.down_proj"
    sd = {f"{prefix}.qweight": torch.from_numpy(np_pack(q)), f"{prefix}.qzeros": torch.from_numpy(np_pack(z)),
          f"{prefix}.scales": torch.from_numpy(s)}
    lin = linear_factory_for(Scheme.AWQ, awq_quantization_config(g))(prefix, sd)
    assert isinstance(lin, AwqLinear) and (lin.in_features, lin.out_features) == (k, n)
    w_dense = torch.from_numpy(np_dequant(q, z, s, g))  # [N, K] fp16
    assert torch.equal(lin.dense_weight(), w_dense)
    x = torch.randn(3, 4, k, generator=torch.Generator().manual_seed(4)).half()
    assert torch.equal(lin(x), F.linear(x, w_dense))
    xf = x.float()  # fp32 activations: (q - z) * s taken in fp32, so no fp16 rounding of the weight
    assert torch.equal(lin(xf), F.linear(xf, torch.from_numpy((q - np.repeat(z, g, 0)).astype(np.float32)
                                                               * np.repeat(s, g, 0).astype(np.float32)).T))
    assert export_tensors_awq(prefix, lin.qweight, lin.qzeros, lin.scales).keys() == sd.keys()


def test_awq_linear_to_and_nbytes():
    lin = AwqLinear.from_dense(torch.randn(16, 64, generator=torch.Generator().manual_seed(5)), 32)
    assert lin.nbytes() == 64 * 2 * 4 + 2 * 2 * 4 + 2 * 16 * 2
    half = lin.to(dtype=torch.float16)
    assert half.dense_weight().dtype == torch.float16 and half.scales.dtype == torch.float16
    # fp32 holds (q - z) * s exactly, so the fp16 product is that value correctly rounded
    assert torch.equal(half.dense_weight(), lin.dense_weight().half())


# --- AutoAWQ's own code, where the package is installed (pip install --no-deps autoawq; accelerate) -------

def _autoawq_file(rel: str) -> Path:
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def _load_packing_utils():
    # packing_utils needs only torch; loading the file alone skips awq/__init__, which imports GPU-era deps
    spec = importlib.util.spec_from_file_location("_autoawq_packing_utils", _autoawq_file("utils/packing_utils.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def autoawq_gemm():
    """AutoAWQ's WQLinear_GEMM, imported under a bare `awq` package; sys.modules is restored afterwards."""
    root = _autoawq_file("")
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    pkg = types.ModuleType("awq")
    pkg.__path__ = [str(root)]
    sys.modules["awq"] = pkg
    try:
        from awq.modules.linear.gemm import WQLinear_GEMM
    except ImportError as e:
        pytest.skip(f"AutoAWQ's gemm module does not import here: {e}")
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return WQLinear_GEMM


def test_autoawq_order_and_dequantizer_agree():
    pu = _load_packing_utils()
    assert tuple(pu.AWQ_ORDER) == AWQ_ORDER and tuple(pu.AWQ_REVERSE_ORDER) == AWQ_REVERSE_ORDER
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).half()
    qweight, qzeros, scales = quantize_awq(w, 64)
    theirs = pu.dequantize_gemm(qweight, qzeros, scales, 4, 64)  # [K, N] fp16
    assert torch.equal(theirs, dequantize_awq(qweight, qzeros, scales, 64, torch.float16).T)


def test_autoawq_packer_writes_our_words(autoawq_gemm):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)).half()
    q, zeros, scales = quantize_awq_rtn(w, 32)
    linear = torch.nn.Linear(128, 32, bias=False)
    linear.weight.data = fake_quantize_awq(w, 32, dtype=torch.float32)  # AutoAWQ packs the pseudo-quantized W
    theirs = autoawq_gemm.from_linear(linear, 4, 32, scales=scales, zeros=zeros.float())
    assert torch.equal(theirs.qweight, pack_awq(q))
    assert torch.equal(theirs.qzeros, pack_awq(zeros))
    assert torch.equal(theirs.scales, scales)
