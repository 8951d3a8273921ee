"""Programmatic dependent launch on the GPU. A kernel so launched starts while the previous one finishes and
waits (griddepcontrol.wait) before it reads what that one wrote: results must be bit-identical to serialized
launches, for long chains of dependent kernels (eagerly and in a captured graph, with new inputs on every
replay so that a read of stale data would show) and for the engine."""

from __future__ import annotations

import pytest
import torch

from kernels_cu import build
from kernels_cu.attention_decode import attention_decode, attention_decode_rope
from kernels_cu.awq_gemv import awq_linear, pack_for_gemv
from kernels_cu.fp16_gemv import fp16_linear, fp16_swiglu
from kernels_cu.int8_gemm import int8_gemm
from kernels_cu.norm_fold import FoldOut
from kernels_cu.quantize import FOLD_SIGNATURE, quantize_fold
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_quant
from kernels_cu.rope_kv import rope_kv, rope_table
from kernels_cu.silu_mul import silu_mul_quant

from .conftest import awq_tensors
from .test_engine import CONFIGS, checkpoint

pytestmark = pytest.mark.gpu

H, F = 4096, 1024
EPS = 1e-5


def _layers(n: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        wn = (1 + 0.1 * torch.randn(H, generator=g)).half().cuda()
        w16 = (torch.randn(H, H, generator=g) / H ** 0.5).half().cuda()
        gate_up = (torch.randn(2 * F, H, generator=g) / H ** 0.5).half().cuda()
        awq = pack_for_gemv(*awq_tensors(H, H, 128, seed=10 + i))
        q8 = torch.randint(-127, 128, (H, F), generator=g, dtype=torch.int8).cuda()
        s8 = torch.full((H,), 1e-4).cuda()
        out.append((wn, w16, gate_up, awq, q8, s8))
    return out


def _chain(h: torch.Tensor, layers) -> torch.Tensor:
    """h [M, H] -> [M, H] through every decode GEMV kind and the row kernels, each reading the last output."""
    for wn, w16, gate_up, awq, q8, s8 in layers:
        h = fp16_linear(rmsnorm(h, wn, EPS), w16, residual=h)
        h = awq_linear(rmsnorm(h, wn, EPS), awq, residual=h)
        q, s = silu_mul_quant(fp16_swiglu(rmsnorm(h, wn, EPS), gate_up).repeat(1, 2))  # [M, F] int8
        h = int8_gemm(q, s, q8, s8, residual=h)
        q, s = rmsnorm_quant(h, wn, EPS)
        h = int8_gemm(q[:, :F].contiguous(), s, q8, s8, residual=h)
    return h


def _captured(chain) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """chain() run once under programmatic launch (compile, allocate), then captured so: (graph, its output)."""
    with build.programmatic():
        chain()
        build.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=build.torch_stream()):
            out = chain()
    return graph, out


def _launched_programmatically() -> int:
    return sum(fn.programmatic_launches for fn in build.loaded_functions())


@pytest.fixture(autouse=True)
def pdl_on(monkeypatch):
    monkeypatch.setenv("FLLAMA_PDL", "1")
    if not build.pdl_supported():
        pytest.skip("programmatic dependent launch needs sm_90 or newer")


@pytest.mark.parametrize("M", [1, 8])
def test_chain_eager_bitwise_equal(M):
    layers = _layers(4)
    g = torch.Generator().manual_seed(M)
    before = _launched_programmatically()
    for trial in range(3):
        x = torch.randn(M, H, generator=g).half().cuda()
        want = _chain(x, layers)
        with build.programmatic():
            got = _chain(x, layers)
        assert torch.isfinite(want).all() and float(want.float().abs().max()) > 0.1
        assert torch.equal(got, want), f"trial {trial}: max diff {float((got.float() - want.float()).abs().max())}"
    # 11 kernels per layer, all programmatic (silu_mul_quant of a few rows is two: silu_mul_part, quantize_fold)
    assert _launched_programmatically() - before == 3 * 4 * 11


@pytest.mark.parametrize("M", [1, 8])
def test_chain_graph_replays_bitwise_equal(M):
    layers = _layers(3)
    static = torch.randn(M, H).half().cuda()
    graph, out = _captured(lambda: _chain(static, layers))
    g = torch.Generator().manual_seed(100 + M)
    for trial in range(6):
        x = torch.randn(M, H, generator=g).half().cuda()
        want = _chain(x, layers)  # serialized launches
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, want), f"replay {trial}: max diff {float((out.float() - want.float()).abs().max())}"


def _int8_fold_chain(h: torch.Tensor, layers) -> torch.Tensor:
    """h [M, H] through int8 GEMVs that defer the next RMSNorm (fold producers) and quantize_fold kernels that
    let the next GEMV launch before their own wait (early=True): that GEMV then overlaps the producer before
    quantize_fold, and must still read quantize_fold's output and nothing older."""
    q, s = rmsnorm_quant(h, layers[0][0], EPS)
    for wn, w8, s8 in layers:
        fold = FoldOut.new(wn, h.shape[0], int8=True)
        h = int8_gemm(q, s, w8, s8, residual=h, fold_out=fold)
        q, s = quantize_fold(fold.xg, fold.mx, fold.part, EPS, early=True)
    return int8_gemm(q, s, layers[0][1], layers[0][2])


@pytest.mark.parametrize("M", [1, 4])
def test_early_quantize_fold_chain_bitwise_equal(M):
    g = torch.Generator().manual_seed(11)
    layers = [((1 + 0.1 * torch.randn(H, generator=g)).half().cuda(),
               torch.randint(-127, 128, (H, H), generator=g, dtype=torch.int8).cuda(),
               (torch.rand(H, generator=g) * 1e-4 + 5e-5).cuda()) for _ in range(6)]
    static = torch.randn(M, H).half().cuda()
    early = build.get_function("quantize.cu", "quantize_fold_early", FOLD_SIGNATURE)
    before = early.programmatic_launches
    graph, out = _captured(lambda: _int8_fold_chain(static, layers))
    assert early.programmatic_launches > before
    for trial in range(6):
        x = torch.randn(M, H, generator=g).half().cuda()
        want = _int8_fold_chain(x, layers)  # serialized launches
        with build.programmatic():
            eager = _int8_fold_chain(x, layers)
        static.copy_(x)
        graph.replay()
        assert torch.isfinite(want).all() and float(want.float().abs().max()) > 0.1
        assert torch.equal(eager, want), f"eager {trial}: max diff {float((eager.float() - want.float()).abs().max())}"
        assert torch.equal(out, want), f"replay {trial}: max diff {float((out.float() - want.float()).abs().max())}"


NH, NKV, D, L = 32, 8, 128, 1024  # attention chains: H = NH * D


def _attention_chain(x, layers, caches, lengths, pos, cos_sin, rope_mode: bool) -> torch.Tensor:
    """x [M, H] through decode layers of q|k|v GEMV -> attention (RoPE mode, or rope_kv then attention) -> o
    GEMV + residual. Each attention must see the new token that the kernel before it (rope_kv) or it itself
    stored, whatever it issues before its PDL wait (an eleventh-session variant copied the older positions
    early: docs/benchmarks.md)."""
    row = torch.arange(x.shape[0], dtype=torch.int32, device="cuda")
    for (w_qkv, w_o), (k, v) in zip(layers, caches):
        qkv = fp16_linear(x, w_qkv)  # [M, (NH + 2 NKV) D]
        if rope_mode:
            o = attention_decode_rope(qkv, cos_sin, k, v, lengths, NH)
        else:
            o = attention_decode(rope_kv(qkv, cos_sin, pos, row, k, v, NH, NKV), k, v, lengths)
        x = fp16_linear(o.reshape(x.shape[0], -1), w_o, residual=x)
    return x


@pytest.mark.parametrize("rope_mode", [True, False], ids=["rope-mode", "rope_kv"])
def test_attention_chain_graph_replays_bitwise_equal(rope_mode):
    """A captured chain replayed at new lengths (the new token in the first, second or a later stage of its
    block) against serialized launches on a copy of the caches: outputs and caches bit for bit."""
    M, n_layers = 2, 3
    g = torch.Generator().manual_seed(7)
    layers = [((torch.randn((NH + 2 * NKV) * D, NH * D, generator=g) / 64).half().cuda(),
               (torch.randn(NH * D, NH * D, generator=g) / 64).half().cuda()) for _ in range(n_layers)]
    caches = [tuple(torch.randn(M, NKV, L, D, generator=g).half().cuda() for _ in "kv") for _ in range(n_layers)]
    ref_caches = [(k.clone(), v.clone()) for k, v in caches]
    cos_sin = rope_table(D, 10000.0, L, device="cuda")
    lengths = torch.tensor([5, 70], dtype=torch.int32, device="cuda")
    pos = lengths - 1
    static = torch.randn(M, NH * D, generator=g).half().cuda()
    graph, out = _captured(lambda: _attention_chain(static, layers, caches, lengths, pos, cos_sin, rope_mode))
    _attention_chain(static, layers, ref_caches, lengths, pos, cos_sin, rope_mode)  # the warm-up's writes
    for trial, lens in enumerate(([6, 71], [17, 64], [65, 129], [300, 1024])):
        lengths.copy_(torch.tensor(lens, dtype=torch.int32))
        pos.copy_(lengths - 1)
        x = torch.randn(M, NH * D, generator=g).half().cuda()
        want = _attention_chain(x, layers, ref_caches, lengths, pos, cos_sin, rope_mode)  # serialized launches
        static.copy_(x)
        graph.replay()
        assert torch.isfinite(want).all()
        assert torch.equal(out, want), f"replay {trial}: max diff {float((out.float() - want.float()).abs().max())}"
        for (k, v), (rk, rv) in zip(caches, ref_caches):
            assert torch.equal(k, rk) and torch.equal(v, rv), f"replay {trial}: caches differ"


@pytest.mark.parametrize("scheme", ["fp16", "int8-dynamic", "awq"])
def test_engine_with_and_without_programmatic_launch(scheme, monkeypatch):
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS["smol-like"]
    w = checkpoint(config, scheme)
    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))

    def run():
        eng = Engine(w, EngineConfig(max_len=128))
        cache = eng.new_cache(2, 64)
        logits = [eng.forward(tokens[:, :32], cache)[:, -1]]
        logits += [eng.forward(tokens[:, i:i + 1], cache)[:, 0] for i in range(32, 40)]  # graph replays
        return torch.stack(logits, 1)

    before = _launched_programmatically()
    on = run()
    assert _launched_programmatically() - before > 9 * config.n_layers  # the prefill's kernels at least
    monkeypatch.setenv("FLLAMA_PDL", "0")
    off = run()
    assert torch.isfinite(on).all()
    assert torch.equal(on, off)
