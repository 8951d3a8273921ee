"""awq_chain (one persistent kernel for o_proj, gate|up, down_proj and the next q|k|v) against the same GEMVs
launched one by one: every output bit for bit, across grid sizes, token counts and graph replays; and the engine
with the chain against the engine without it."""

import pytest
import torch

from tests.gpu.conftest import GPU_STACK, SKIP_REASON, assert_equal, awq_tensors, poison, randn

if not GPU_STACK:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kernels_cu import awq_chain as chain_mod, awq_gemv, build  # noqa: E402
from kernels_cu.awq_chain import awq_chain  # noqa: E402
from kernels_cu.awq_gemv import awq_linear, pack_for_gemv  # noqa: E402
from kernels_cu.norm_fold import FoldOut  # noqa: E402

pytestmark = pytest.mark.gpu

EPS = 1e-5
# (H, F, q|k|v channels): a small layer (panels 32 / 64 / 32 / 48: fewer than the blocks) and LLaMA-2-7B's
# (256 / 1376 / 256 / 768: gate|up has more panels than the grid has blocks)
LAYERS = [(512, 1024, 768), (4096, 11008, 12288)]


def layer_ops(H: int, F: int, Q: int, seed: int):
    """Random AWQ ops with groups of 128 in the GEMV layout: o [H <- H], gate|up (SwiGLU) [2F <- H], down
    [H <- F], q|k|v [Q <- H]."""
    def op(K, N, s, swiglu=False):
        return pack_for_gemv(*awq_tensors(K, N, 128, seed=seed + s), swiglu=swiglu)
    return op(H, H, 0), op(H, 2 * F, 1, swiglu=True), op(F, H, 2), op(H, Q, 3)


def norm_weight(H: int, seed: int) -> torch.Tensor:
    return (randn(H, seed=seed) * 0.3 + 1.0).half()


def separate(o_in, h, o, gate_up, down, qkv, w_ffn, w_next):
    """The chain's GEMVs one kernel each, on the 8-warp entries the chain's body equals (awq_linear picks them
    where a grid has few panels; WIDE_WAVES is raised so it picks them for every shape here)."""
    M = h.shape[0]
    ffn, nxt = FoldOut.new(w_ffn, M), FoldOut.new(w_next, M)
    h1 = awq_linear(o_in, o, residual=h, fold_out=ffn)
    a = awq_linear(ffn.xg, gate_up, fold_in=ffn.consumer(EPS))
    h2 = awq_linear(a, down, residual=h1, fold_out=nxt)
    q = awq_linear(nxt.xg, qkv, fold_in=nxt.consumer(EPS)) if qkv is not None else None
    return (h1, a, h2, q), ffn, nxt


def chained(o_in, h, o, gate_up, down, qkv, w_ffn, w_next, blocks=None):
    M = h.shape[0]
    ffn, nxt = FoldOut.new(w_ffn, M), FoldOut.new(w_next, M)
    poison(ffn.xg, ffn.part, nxt.xg, nxt.part)
    out = awq_chain(o_in, h, o, gate_up, down, ffn, nxt, EPS, qkv, blocks=blocks)
    return (out.h1, out.a, out.h2, out.qkv), ffn, nxt


def check_same(got, want, what):
    (outs, ffn, nxt), (routs, rffn, rnxt) = got, want
    for name, a, b in zip(("h1", "a", "h2", "qkv"), outs, routs):
        if b is None:
            assert a is None
            continue
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        assert_equal(a, b, f"{what}: {name}")
    for name, a, b in (("ffn.xg", ffn.xg, rffn.xg), ("ffn.part", ffn.part, rffn.part), ("next.xg", nxt.xg, rnxt.xg),
                       ("next.part", nxt.part, rnxt.part)):
        assert_equal(a, b, f"{what}: {name}")


@pytest.mark.parametrize("with_qkv", [True, False])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("H,F,Q", LAYERS)
def test_chain_equals_the_separate_gemvs(H, F, Q, M, with_qkv, monkeypatch):
    monkeypatch.setattr(awq_gemv, "WIDE_WAVES", 1e9)
    o, gate_up, down, qkv = layer_ops(H, F, Q, seed=H + M)
    qkv = qkv if with_qkv else None
    o_in, h = randn(M, H, seed=M), randn(M, H, scale=4.0, seed=M + 1)
    w_ffn, w_next = norm_weight(H, 5), norm_weight(H, 6)
    want = separate(o_in, h, o, gate_up, down, qkv, w_ffn, w_next)
    check_same(chained(o_in, h, o, gate_up, down, qkv, w_ffn, w_next), want, f"H={H} M={M}")


@pytest.mark.parametrize("blocks", [1, 3, 7, 40])
def test_any_grid_size(blocks, monkeypatch):
    """Few blocks, each looping over many panels of every phase (and idle in none, or some)."""
    monkeypatch.setattr(awq_gemv, "WIDE_WAVES", 1e9)
    H, F, Q = LAYERS[0]
    o, gate_up, down, qkv = layer_ops(H, F, Q, seed=blocks)
    o_in, h = randn(2, H, seed=blocks), randn(2, H, scale=4.0, seed=blocks + 1)
    w_ffn, w_next = norm_weight(H, 5), norm_weight(H, 6)
    want = separate(o_in, h, o, gate_up, down, qkv, w_ffn, w_next)
    check_same(chained(o_in, h, o, gate_up, down, qkv, w_ffn, w_next, blocks=blocks), want, f"blocks={blocks}")


def test_graph_replays_with_new_inputs(monkeypatch):
    """Captured once and replayed with new activations: the barrier word carries over between launches (its
    value does not matter) and every replay equals the eager GEMVs."""
    monkeypatch.setattr(awq_gemv, "WIDE_WAVES", 1e9)
    H, F, Q = LAYERS[0]
    o, gate_up, down, qkv = layer_ops(H, F, Q, seed=9)
    w_ffn, w_next = norm_weight(H, 5), norm_weight(H, 6)
    o_in, h = randn(1, H, seed=1), randn(1, H, scale=4.0, seed=2)
    ffn, nxt = FoldOut.new(w_ffn, 1), FoldOut.new(w_next, 1)
    awq_chain(o_in, h, o, gate_up, down, ffn, nxt, EPS, qkv)  # warm-up: builds, allocates the barrier word
    build.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=build.torch_stream()):
        out = awq_chain(o_in, h, o, gate_up, down, ffn, nxt, EPS, qkv)
    for r in range(3):
        o_in.copy_(randn(1, H, seed=10 + r))
        h.copy_(randn(1, H, scale=4.0, seed=20 + r))
        graph.replay()
        (rh1, ra, rh2, rq), rffn, rnxt = separate(o_in, h, o, gate_up, down, qkv, w_ffn, w_next)
        check_same(((out.h1, out.a, out.h2, out.qkv), ffn, nxt), ((rh1, ra, rh2, rq), rffn, rnxt), f"replay {r}")


def test_refuses_what_it_cannot_run():
    H, F, Q = LAYERS[0]
    o, gate_up, down, qkv = layer_ops(H, F, Q, seed=3)
    w = norm_weight(H, 5)
    ffn, nxt = FoldOut.new(w, 1), FoldOut.new(w, 1)
    o_in, h = randn(1, H), randn(1, H)
    with pytest.raises(ValueError, match="resident"):
        awq_chain(o_in, h, o, gate_up, down, ffn, nxt, EPS, qkv, blocks=10**6)
    with pytest.raises(ValueError, match="tokens"):  # two token tiles
        awq_chain(randn(9, H), randn(9, H), o, gate_up, down, FoldOut.new(w, 9), FoldOut.new(w, 9), EPS, qkv)
    with pytest.raises(ValueError, match="SwiGLU"):
        awq_chain(o_in, h, o, down, down, ffn, nxt, EPS, qkv)
    g64 = pack_for_gemv(*awq_tensors(H, H, 64, seed=1))
    with pytest.raises(ValueError, match="groups of 128"):
        awq_chain(o_in, h, g64, gate_up, down, ffn, nxt, EPS, qkv)


def test_the_engine_with_the_chain_equals_the_engine_without():
    """Decode steps (eager and graph) of a group-128 AWQ model at batch 1 and 3 (bucket 4, the last folded one):
    the same logits and the same KV cache bits with chain_gemvs on and off; the chain's kernel did run."""
    from kernels_cu.engine import Engine, EngineConfig
    from tests.gpu.test_engine import CONFIGS, checkpoint, decode_steps

    config = CONFIGS["gqa4-d64"]
    w = checkpoint(config, "awq-g128")
    fn = build.get_function("awq_chain.cu", chain_mod.ENTRY, chain_mod.SIGNATURE)
    for graphs in (True, False):
        for batch in (1, 3):
            tokens = torch.randint(0, config.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(batch))
            results = []
            for on in (True, False):
                eng = Engine(w, EngineConfig(max_len=64, use_graphs=graphs, chain_gemvs=on))
                assert eng._chains(4) == on and not eng._chains(8)
                before = fn.launches
                steps, cache = decode_steps(eng, tokens, 7, max_len=32)
                assert (fn.launches > before) == on  # eager calls, or the graph's capture
                results.append((steps, [t.clone() for t in cache.k + cache.v]))
            assert torch.isfinite(results[0][0]).all()
            assert torch.equal(results[0][0], results[1][0]), f"graphs={graphs} batch={batch}: logits differ"
            for a, b in zip(results[0][1], results[1][1]):
                assert torch.equal(a, b)
