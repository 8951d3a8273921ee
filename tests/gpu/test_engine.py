"""The engine against the reference backend on the same checkpoint, for every scheme (random weights)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_zoo.quant.int8 import ActQuant
from model_zoo.config import LlamaConfig
from model_zoo.generation import GenerationConfig, generate
from model_zoo.quant.linear import AwqLinear, Int8Linear
from model_zoo.reference import ReferenceModel
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from model_zoo.weights import ModelWeights, random_state_dict

pytestmark = pytest.mark.gpu

CONFIGS = {
    "gqa4-d64": LlamaConfig(512, 2, 8, 2, 1024, 1000, rope_theta=10000.0, max_positions=512, name="t1"),
    "smol-like": LlamaConfig(576, 2, 9, 3, 1536, 777, rope_theta=100000.0, max_positions=512, tie_embeddings=True,
                             name="t2"),
    "mha-d128": LlamaConfig(512, 2, 4, 4, 1024, 1000, max_positions=512, name="t3"),
}
SCHEMES = ("fp16", "int8-dynamic", "int8-static", "awq")


def checkpoint(config: LlamaConfig, scheme: str, seed: int = 0, group_size: int = 64) -> ModelWeights:
    """Random weights quantized with the CPU quantizers, as a loaded checkpoint would be (awq: groups of
    group_size)."""
    sd = random_state_dict(config, seed=seed)
    sd["model.embed_tokens.weight"] *= 0.05 * config.hidden_size ** 0.5  # logits of a trained model's scale
    w = ModelWeights.from_state_dict(config, sd, meta={"scheme": scheme.split("-")[0]})
    if scheme == "fp16":
        return w.to(dtype=torch.float16)
    layers = []
    for layer in w.layers:
        lin = {}
        for attr, dense in layer.linears().items():
            W = dense.dense_weight().float()
            if scheme == "awq":
                lin[attr] = AwqLinear.from_dense(W, group_size)
            else:
                static = scheme == "int8-static"
                lin[attr] = Int8Linear.from_dense(W, ActQuant.STATIC if static else ActQuant.DYNAMIC,
                                                  4.0 if static else None, scale_dtype=torch.float16)
        layers.append(dataclasses.replace(layer, **lin))
    return dataclasses.replace(w, layers=layers).to(dtype=torch.float16)


def engine_and_ref(config, scheme):
    from kernels_cu.engine import Engine, EngineConfig

    w = checkpoint(config, scheme)
    return Engine(w, EngineConfig(max_len=256)), ReferenceModel(w.to("cpu", torch.float32))


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def decode_steps(eng, tokens: torch.Tensor, prefix: int, max_len: int = 64):
    """Prefill tokens[:, :prefix] into a fresh cache, then decode the rest a token per step (the decode graph
    or its eager kernels): (logits [steps, B, V], the cache)."""
    cache = eng.new_cache(tokens.shape[0], max_len)
    eng.forward(tokens[:, :prefix], cache)
    return torch.stack([eng.forward(tokens[:, i:i + 1], cache)[:, 0] for i in range(prefix, tokens.shape[1])]), cache


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_logits_match_reference(name, scheme):
    config = CONFIGS[name]
    eng, ref = engine_and_ref(config, scheme)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 37), generator=g)
    want = ref.forward(tokens)  # [2, 37, V] fp32 on the CPU
    got = eng.forward(tokens)
    assert torch.isfinite(got).all()
    assert rel(got, want) < 2e-2, f"prefill {name} {scheme}"
    # decode through the graph: prefill 30 then 7 single steps for both rows
    steps, cache = decode_steps(eng, tokens, 30)
    assert rel(steps.transpose(0, 1), want[:, 30:]) < 2e-2, f"decode {name} {scheme}"
    assert cache.lengths.tolist()[:2] == [37, 37]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_tokens_equal_reference_for_32_steps(scheme):
    config = CONFIGS["smol-like"]
    eng, ref = engine_and_ref(config, scheme)
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompt = [tok.encode("The engine and the reference agree")]
    want = generate(ref, tok, prompt, cfg)[0][0].tokens
    got = generate(eng, tok, prompt, cfg)[0][0].tokens
    assert got == want


@pytest.mark.parametrize("scheme", ("fp16", "int8-dynamic", "awq"))
def test_ragged_batch_equals_each_prompt_alone(scheme):
    check_ragged_batch(engine_and_ref(CONFIGS["gqa4-d64"], scheme)[0])


def check_ragged_batch(eng) -> None:
    """Four prompts of different lengths generated as one batch give each prompt's tokens alone."""
    config = eng.config
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompts = [tok.encode(p) for p in ("a", "a much longer prompt than the first one", "middle one", "xy z")]
    batch = generate(eng, tok, prompts, cfg)[0]
    for p, row in zip(prompts, batch):
        assert row.tokens == generate(eng, tok, [p], cfg)[0][0].tokens


def test_graph_replay_equals_eager_decode():
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS["gqa4-d64"]
    w = checkpoint(config, "int8-dynamic")
    graphed, eager = Engine(w, EngineConfig(max_len=128)), Engine(w, EngineConfig(max_len=128, use_graphs=False))
    tokens = torch.randint(0, config.vocab_size, (3, 12))
    outs = [decode_steps(eng, tokens, 8)[0] for eng in (graphed, eager)]
    assert rel(outs[0], outs[1]) < 1e-3


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_graph_replays_equal_eager_prefills(scheme):
    """A prefill shape's second run captures a graph and later runs replay it: the same logits, cache and lengths
    as eager prefills of the same tokens, new tokens each time, from position 0 and continuing a row."""
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT

    config = CONFIGS["smol-like"]
    w = checkpoint(config, scheme)
    graphed, eager = Engine(w, EngineConfig(max_len=256)), Engine(w, EngineConfig(max_len=256, prefill_graphs=False))
    g = torch.Generator().manual_seed(7)
    caches = [graphed.new_cache(2, 128), eager.new_cache(2, 128)]
    held = None  # the previous run's logits and a copy of them
    for run in range(4):  # eager, capture + replay, replay, replay
        first = torch.randint(0, config.vocab_size, (2, 24), generator=g)
        more = torch.randint(0, config.vocab_size, (1, 9), generator=g)  # row 1 continues at 24
        outs = []
        for eng, cache in zip((graphed, eager), caches):
            cache.lengths.zero_()
            a = eng.forward(first, cache)
            b = eng.forward(more, cache, torch.tensor([1]))
            outs.append((a, b, cache.lengths.clone(), [t[:, :, :33].clone() for t in cache.k + cache.v]))
        (a0, b0, n0, kv0), (a1, b1, n1, kv1) = outs
        assert torch.isfinite(a0).all() and torch.equal(a0, a1) and torch.equal(b0, b1), run
        assert n0.tolist()[:2] == n1.tolist()[:2] == [24, 33]
        assert all(torch.equal(x, y) for x, y in zip(kv0, kv1))
        assert len(caches[0].prefill_graphs) == (0 if run == 0 else 2)
        if held is not None:  # the logits handed out before are the caller's: a later replay leaves them alone
            assert torch.equal(held[0], held[1])
        held = (a0, a0.clone())
    assert not eager.new_cache(2, 128).prefill_graphs
    # a third shape drops the least recently used graph; a prefill above the limit never gets one
    cache = caches[0]
    for _ in range(2):
        cache.lengths.zero_()
        graphed.forward(torch.randint(0, config.vocab_size, (1, 5), generator=g), cache)
    # keys: (rows, length, starts, last): forward(last=True) computes other logits and has graphs of its own
    assert len(cache.prefill_graphs) == DEFAULT.prefill_graphs and ((0,), 5, (0,), False) in cache.prefill_graphs
    assert ((0, 1), 24, (0, 0), False) not in cache.prefill_graphs
    long = torch.randint(0, config.vocab_size, (8, DEFAULT.prefill_graph_tokens // 8 + 1))  # [8, limit / 8 + 1]: over the limit
    for _ in range(2):
        big = graphed.new_cache(8, long.shape[1] + 1)
        graphed.forward(long, big)
    assert not big.prefill_graphs


def test_awq_prefill_graph_on_the_fused_gemm_equals_eager(monkeypatch):
    """awq with groups of 128 prefills more than awq_gemv_max_m rows on awq_wgmma.cu (Hopper), whose x tensor maps a
    captured prefill writes with put_map (tensor_map.py): every replay gives the eager prefill's logits and cache.
    Replays once read stale maps (no tensormap-proxy acquire before the TMA) where the capture had put the maps of
    several GEMMs at one reused address: logits off by up to 7 at LLaMA-2-7B's shapes, different each replay."""
    from kernels_cu import awq_wgmma, build
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT

    if not build.has_wgmma(torch.cuda.current_device()):
        pytest.skip("the fused AWQ prefill GEMM runs on Hopper only")
    config = CONFIGS["mha-d128"]
    w = checkpoint(config, "awq", group_size=128)
    graphed, eager = Engine(w, EngineConfig(max_len=128)), Engine(w, EngineConfig(max_len=128, prefill_graphs=False))
    fused, launch = [], awq_wgmma.launch
    monkeypatch.setattr(awq_wgmma, "launch", lambda *a: fused.append(1) or launch(*a))
    g = torch.Generator().manual_seed(11)
    caches = [graphed.new_cache(2, 64), eager.new_cache(2, 64)]
    for run in range(4):  # eager, capture + replay, replay, replay
        tokens = torch.randint(0, config.vocab_size, (2, 48), generator=g)  # 96 rows > awq_gemv_max_m
        outs = []
        for eng, cache in zip((graphed, eager), caches):
            cache.lengths.zero_()
            logits = eng.forward(tokens, cache)
            outs.append((logits, [t[:, :, :48].clone() for t in cache.k + cache.v]))
        (a0, kv0), (a1, kv1) = outs
        assert torch.isfinite(a0).all() and torch.equal(a0, a1), run
        assert all(torch.equal(x, y) for x, y in zip(kv0, kv1)), run
    assert len(caches[0].prefill_graphs) == 1 and 2 * 48 > DEFAULT.awq_gemv_max_m
    assert len(fused) >= 4 * config.n_layers * 4  # the four GEMMs a layer, eagerly in both engines and captured


def test_gpu_sampling_in_the_loop():
    config = CONFIGS["gqa4-d64"]
    eng, _ = engine_and_ref(config, "fp16")
    tok = Tokenizer.byte_fallback(config.vocab_size)
    run = lambda seed: generate(eng, tok, [tok.encode("sample me")], GenerationConfig(
        max_new_tokens=16, stop_at_eos=False,
        sampling=SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=seed)))[0][0].tokens
    a, b, c = run(3), run(3), run(4)
    assert a == b and a != c and all(0 <= t < config.vocab_size for t in a)
    for _ in range(8):  # unseeded: a fresh seed each time (torch.seed() overflowed CUDA's generator half the time)
        assert len(run(None)) == 16


def test_chat_cache_reuse_on_the_engine():
    from model_zoo.chat import ChatSession

    config = CONFIGS["smol-like"]
    eng, _ = engine_and_ref(config, "fp16")
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    chat = ChatSession(eng, tok, cfg, system="sys", max_len=256)
    chat.send("hello")
    chat.send("again")
    n = int(chat.cache.lengths[0])
    cached = eng.forward(torch.tensor([[42]]), chat.cache, torch.tensor([0]))[0, -1]
    fresh = eng.forward(torch.tensor([chat.cached_ids + [42]]))[0, -1]
    assert n == len(chat.cached_ids) and rel(cached, fresh) < 1e-2


@pytest.mark.parametrize("kv", ("int8", "fp8"))
@pytest.mark.parametrize("scheme", ("fp16", "int8-dynamic"))
def test_8bit_kv_cache_options(scheme, kv):
    """--kv-int8 / --kv-fp8: codes of the kind's dtype with a scale per (row, head, position); prefill and decode
    logits near the reference's (the cache's own error on top of the scheme's); about half the fp16 cache's bytes."""
    from kernels_cu.engine import Engine, EngineConfig, KvKind

    config = CONFIGS["smol-like"]
    w = checkpoint(config, scheme)
    eng = Engine(w, EngineConfig(max_len=256, kv=kv))
    ref = ReferenceModel(w.to("cpu", torch.float32))
    tokens = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    want = ref.forward(tokens)
    cache = eng.new_cache(2, 64)
    assert cache.k[0].dtype == KvKind(kv).dtype and cache.k_scale[0].shape == cache.k[0].shape[:3]
    got = torch.cat([eng.forward(tokens[:, :32], cache)] +
                    [eng.forward(tokens[:, i:i + 1], cache) for i in range(32, 40)], 1)
    assert rel(got, want) < 5e-2
    assert eng.kv_bytes(1, 100) < Engine(w, EngineConfig(max_len=256)).kv_bytes(1, 100)


@pytest.mark.parametrize("name,scheme", [("smol-like", "fp16"), ("gqa4-d64", "int8-dynamic"), ("mha-d128", "awq"),
                                         ("smol-like", "awq")])
def test_int8_lm_head_option(name, scheme):
    """EngineConfig.lm_head_int8: prefill (cuBLAS on dequantized chunks) and decode (the w8a16 GEMV, the final norm
    deferred into it where the scheme folds) against the reference with the same int8-rounded head
    (model_zoo.quant.checkpoint.int8_round_trip, what `--lm-head-int8` gives the CPU reference); greedy tokens equal; the
    bytes a step reads count the codes and scales; an untied fp16 head is not kept."""
    from model_zoo.quant.checkpoint import int8_round_trip
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS[name]
    w = checkpoint(config, scheme)
    eng, plain = Engine(w, EngineConfig(max_len=256, lm_head_int8=True)), Engine(w, EngineConfig(max_len=256))
    rw = w.to("cpu", torch.float32)
    ref = ReferenceModel(dataclasses.replace(rw, lm_head=int8_round_trip(rw.lm_head)))
    tokens = torch.randint(0, config.vocab_size, (3, 30), generator=torch.Generator().manual_seed(8))
    want = ref.forward(tokens)  # [3, 30, V]
    assert rel(eng.forward(tokens), want) < 2e-2, "prefill"
    steps, _ = decode_steps(eng, tokens, 22)
    assert rel(steps.transpose(0, 1), want[:, 22:]) < 2e-2, "decode"
    base, _ = decode_steps(plain, tokens, 22)
    assert 0 < rel(steps, base) < 2e-2  # the head's rounding shows, and only it
    V, H = config.vocab_size, config.hidden_size
    assert eng.step_weight_bytes(2) == plain.step_weight_bytes(2) - V * H * 2 + V * H + V * 4
    assert (eng.lm_head is None) != config.tie_embeddings
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompt = [tok.encode("an int8 head")]
    assert generate(eng, tok, prompt, cfg)[0][0].tokens == generate(ref, tok, prompt, cfg)[0][0].tokens


def test_int8_lm_head_switched_on_keeps_the_fp16_head():
    """A variant with lm_head_int8 of an engine built without it (engine_ab): the codes are made on first use and
    the fp16 head stays, so the engine it came from still gives the fp16 logits."""
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS["gqa4-d64"]
    eng = Engine(checkpoint(config, "awq"), EngineConfig(max_len=128))
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    a = decode_steps(eng, tokens, 8)[0]
    on = eng.variant(lm_head_int8=True)
    b = decode_steps(on, tokens, 8)[0]
    assert on.lm_head_q is not None and on.lm_head is not None and 0 < rel(b, a) < 2e-2
    assert eng.lm_head_q is None
    assert torch.equal(decode_steps(eng, tokens, 8)[0], a)


def test_callers_on_the_default_stream_see_finished_results():
    """The CLI calls the engine from torch's default stream (the fixture runs tests on fllama's own stream, which
    hid a race once): results read there must be complete, and inputs made there must be complete when read."""
    config = CONFIGS["smol-like"]
    eng, ref = engine_and_ref(config, "int8-dynamic")
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    prompts = [tok.encode("default stream"), tok.encode("a second, longer prompt on it")]
    with torch.cuda.stream(torch.cuda.default_stream()):
        got = [r.tokens for r in generate(eng, tok, prompts, cfg)[0]]
    want = [r.tokens for r in generate(ref, tok, prompts, cfg)[0]]
    assert got == want


@pytest.mark.parametrize("scheme", ("fp16", "awq"))
def test_folded_norms_match_the_rmsnorm_kernels(scheme):
    """Decode with the RMSNorms deferred into the GEMVs (the default for small batches) against the same engine
    with rmsnorm.cu kernels: the same logits up to rounding, in eager steps and graph replays."""
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT

    config = CONFIGS["smol-like"]
    w = checkpoint(config, scheme)
    folded, plain = Engine(w, EngineConfig(max_len=128)), Engine(w, EngineConfig(max_len=128, fold_norms=False))
    most = getattr(DEFAULT, f"fold_max_rows_{scheme}")
    assert folded.plan(1).fold and folded.plan(most).fold and not folded.plan(most + 1).fold
    assert not plain.plan(1).fold
    tokens = torch.randint(0, config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(2))
    outs = [decode_steps(eng, tokens, 8)[0] for eng in (folded, plain)]
    assert torch.isfinite(outs[0]).all()
    assert rel(outs[0], outs[1]) < 3e-3
    steps, _ = decode_steps(Engine(w, EngineConfig(max_len=128, use_graphs=False)), tokens, 8)
    assert rel(steps, outs[0]) < 1e-5  # the same kernels, with or without the graph


@pytest.mark.parametrize("name,scheme,rows", [("gqa4-d64", "int8-dynamic", 1), ("smol-like", "int8-dynamic", 3),
                                               ("mha-d128", "int8-static", 8)])
def test_int8_folded_norms_match_the_rmsnorm_kernels(name, scheme, rows):
    """An int8 decode step with its RMSNorms deferred (o_proj / down_proj write xg, sums and maxima, quantize_fold
    quantizes xg for q|k|v and gate|up) against the same engine with rmsnorm_quant kernels: as near the reference
    (the fold drops an fp16 rounding, so some codes move by one), in graph replays and eager steps; beyond the
    GEMVs' rows, or with fold_norms=False, the kernels stay."""
    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.fp16_gemv import DECODE_MAX_M

    config = CONFIGS[name]
    w = checkpoint(config, scheme)
    folded, plain = Engine(w, EngineConfig(max_len=128)), Engine(w, EngineConfig(max_len=128, fold_norms=False))
    assert folded.plan(1).int8_fold and folded.plan(DECODE_MAX_M).int8_fold
    assert not folded.plan(DECODE_MAX_M + 1).int8_fold
    assert not plain.plan(1).int8_fold and not folded.plan(1).fold  # the fp16 / AWQ fold is not int8's
    tokens = torch.randint(0, config.vocab_size, (rows, 14), generator=torch.Generator().manual_seed(2))
    outs = [decode_steps(eng, tokens, 8)[0] for eng in (folded, plain)]
    assert torch.isfinite(outs[0]).all()
    want = ReferenceModel(w.to("cpu", torch.float32)).forward(tokens)[:, 8:].transpose(0, 1)  # [steps, rows, V]
    err_fold, err_plain = rel(outs[0], want), rel(outs[1], want)
    assert err_fold < 2e-2 and err_fold < 1.25 * err_plain, (err_fold, err_plain)
    steps, _ = decode_steps(Engine(w, EngineConfig(max_len=128, use_graphs=False)), tokens, 8)
    assert torch.equal(steps, outs[0])  # the same kernels, with or without the graph


@pytest.mark.parametrize("name,scheme", [("gqa4-d64", "int8-dynamic"), ("smol-like", "int8-dynamic"),
                                         ("mha-d128", "int8-static")])
def test_one_row_quantized_in_the_gemv_loops_gives_the_same_bits(name, scheme):
    """At one row the int8 GEMVs quantize their inputs in their main loops: q|k|v and gate|up the deferred norms
    from the producers' partials (no quantize_fold kernels; q|k|v clears the SwiGLU's row max), o_proj and down_proj
    attention's and the SwiGLU's output. Against the quantize_fold kernels and the prologue: the same logits bit for
    bit over graph replays (every layer and step reuses the row-max buffer) and eager steps."""
    from dataclasses import replace

    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.tuning import DEFAULT

    config = CONFIGS[name]
    w = checkpoint(config, scheme)
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(8))
    outs = []
    for loop in (True, False):
        t = replace(DEFAULT, norm_row_loop=loop, xq_row_loop=loop)
        outs.append(decode_steps(Engine(w, EngineConfig(max_len=64), t), tokens, 7, max_len=32)[0])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    eager, _ = decode_steps(Engine(w, EngineConfig(max_len=64, use_graphs=False)), tokens, 7, max_len=32)
    assert torch.equal(eager, outs[1])


@pytest.mark.parametrize("scheme,kv", [("fp16", "fp16"), ("int8-dynamic", "fp16"), ("awq", "int8"),
                                       ("int8-dynamic", "fp8")])
def test_rope_in_attention_equals_the_rope_kv_kernel(scheme, kv):
    """Decode with RoPE and the K/V write inside the attention kernel (the default) gives the same bits as
    rope_kv followed by attention: logits and the whole KV cache."""
    from kernels_cu.engine import Engine, EngineConfig

    config = CONFIGS["gqa4-d64"]
    w = checkpoint(config, scheme)
    tokens = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    logits, caches = [], []
    for fuse in (True, False):
        steps, cache = decode_steps(Engine(w, EngineConfig(max_len=64, kv=kv, fuse_rope=fuse)), tokens, 7,
                                    max_len=32)
        logits.append(steps)
        caches.append([t.view(torch.uint8).clone() for t in cache.k + cache.v + cache.k_scale + cache.v_scale])
    assert torch.equal(logits[0], logits[1])
    for a, b in zip(*caches):
        assert torch.equal(a, b)  # bytes: every cache dtype compares


@pytest.mark.parametrize("name,rows", [("gqa4-d64", 3), ("smol-like", 1), ("mha-d128", 8)])
def test_deferred_int8_quantization_gives_the_same_bits(name, rows):
    """int8 decode with the SwiGLU in the gate|up GEMV and o_proj / down_proj quantizing their own inputs (the
    default up to tuning.defer_quant_max_rows rows; here up to the kernels' 8) against the kernels that quantize first: the same
    logits bit for bit, in graph replays and eager steps; more rows, or static activations, keep the quantize
    kernels."""
    from dataclasses import replace

    from kernels_cu.engine import Engine, EngineConfig
    from kernels_cu.int8_gemm import XQ_KERNEL_ROWS
    from kernels_cu.tuning import DEFAULT

    config = CONFIGS[name]
    w = checkpoint(config, "int8-dynamic")
    no_fold = replace(DEFAULT, fold_int8=False)  # the deferred norms change rounding (their own test above)
    default = Engine(w, EngineConfig(max_len=64), no_fold)
    assert default.plan(1).defer_o and not default.plan(DEFAULT.defer_quant_max_rows + 1).defer_o
    t = replace(no_fold, defer_quant_max_rows=XQ_KERNEL_ROWS)
    deferred = default.variant(defer_quant_max_rows=XQ_KERNEL_ROWS)
    plain = Engine(w, EngineConfig(max_len=64, defer_int8_quant=False), t)
    assert deferred.plan(rows).defer_o and deferred.plan(rows).defer_down
    assert not plain.plan(1).defer_o
    assert not Engine(checkpoint(config, "int8-static"), EngineConfig(max_len=64), t).plan(1).defer_o
    tokens = torch.randint(0, config.vocab_size, (rows, 12), generator=torch.Generator().manual_seed(6))
    outs = [decode_steps(eng, tokens, 7, max_len=32)[0] for eng in (deferred, plain)]
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    eager, _ = decode_steps(Engine(w, EngineConfig(max_len=64, use_graphs=False), t), tokens, 7, max_len=32)
    assert torch.equal(eager, outs[0])


@pytest.mark.parametrize("bad", [-1, 1000])
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    from model_zoo.errors import PromptError

    eng, _ = engine_and_ref(CONFIGS["gqa4-d64"], "fp16")  # vocabulary of 1,000
    with pytest.raises(PromptError, match="outside the model's vocabulary"):
        eng.forward(torch.tensor([[1, bad, 2]]))
    with pytest.raises(PromptError, match="outside the model's vocabulary"):
        eng.forward(torch.tensor([[bad]]), eng.new_cache(1, 16))
