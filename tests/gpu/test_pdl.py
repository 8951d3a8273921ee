"""Programmatic dependent launch on the GPU. A kernel so launched starts while the previous one finishes and
waits (griddepcontrol.wait) before it reads what that one wrote: results must be bit-identical to serialized
launches, for long chains of dependent kernels (eagerly and in a captured graph, with new inputs on every
replay so that a read of stale data would show) and for the engine."""

from __future__ import annotations

import pytest
import torch

from kernels_cu import build
from kernels_cu.awq_gemv import awq_linear, pack_for_gemv
from kernels_cu.fp16_gemv import fp16_linear, fp16_swiglu
from kernels_cu.int8_gemm import int8_gemm
from kernels_cu.rmsnorm import rmsnorm, rmsnorm_quant
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


def _launched_programmatically() -> int:
    return sum(fn.programmatic_launches for fn in build._state.get("functions", {}).values())


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
    assert _launched_programmatically() - before == 3 * 4 * 10  # 10 kernels per layer, all programmatic


@pytest.mark.parametrize("M", [1, 8])
def test_chain_graph_replays_bitwise_equal(M):
    layers = _layers(3)
    static = torch.randn(M, H).half().cuda()
    with build.programmatic():
        _chain(static, layers)  # warm-up: compile, allocate
        build.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=build.torch_stream()):
            out = _chain(static, layers)
    g = torch.Generator().manual_seed(100 + M)
    for trial in range(6):
        x = torch.randn(M, H, generator=g).half().cuda()
        want = _chain(x, layers)  # serialized launches
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, want), f"replay {trial}: max diff {float((out.float() - want.float()).abs().max())}"


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
