"""The engine's decode pipe (kernels_cu/engine/pipe.py): steps replayed ahead of the host give the step-by-step
loop's tokens, cache lengths and samples; a cache's leading rows decode on the smaller bucket's graph."""

from __future__ import annotations

import pytest
import torch

from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from tests.gpu.test_engine import CONFIGS, checkpoint
from tests.helpers import EosTokenizer

pytestmark = pytest.mark.gpu

GREEDY = SamplingConfig(temperature=0)


def engines(name: str, scheme: str):
    """(the engine with its default pipe depth, the same weights reading every step before launching the next)"""
    from kernels_cu.engine import Engine, EngineConfig

    eng = Engine(checkpoint(CONFIGS[name], scheme), EngineConfig(max_len=256))
    assert eng.cfg.pipe_depth >= 2
    return eng, eng.variant(pipe_depth=1)


def outcome(eng, tok, prompts, cfg):
    cache = eng.new_cache(len(prompts), 128)
    res, stats = generate(eng, tok, prompts, cfg, cache=cache)
    return [(r.tokens, r.text, r.finish_reason) for r in res], cache.lengths[:len(prompts)].tolist()


@pytest.mark.parametrize("name,scheme", [("gqa4-d64", "fp16"), ("smol-like", "int8-dynamic"), ("mha-d128", "awq")])
def test_run_ahead_equals_step_by_step(name, scheme):
    ahead, stepwise = engines(name, scheme)
    base = Tokenizer.byte_fallback(CONFIGS[name].vocab_size)
    prompts = [base.encode("a"), base.encode("a longer prompt here"), base.encode("mid size")]
    free = generate(stepwise, base, prompts, GenerationConfig(20, GREEDY, stop_at_eos=False))[0]
    eos = EosTokenizer(base, {free[1].tokens[5]})  # row 1 ends early, the others go on
    for tok, cfg in [(base, GenerationConfig(20, GREEDY, stop_at_eos=False)), (eos, GenerationConfig(20, GREEDY)),
                     (base, GenerationConfig(20, GREEDY, stop_strings=(free[0].text[3:5],))),
                     (base, GenerationConfig(2, GREEDY, stop_at_eos=False))]:
        want = outcome(stepwise, tok, prompts, cfg)
        assert outcome(ahead, tok, prompts, cfg) == want
    assert outcome(ahead, eos, prompts, GenerationConfig(20, GREEDY))[0][1][2] == "eos"


def test_seeded_sampling_equals_step_by_step():
    ahead, stepwise = engines("gqa4-d64", "fp16")
    tok = Tokenizer.byte_fallback(CONFIGS["gqa4-d64"].vocab_size)
    cfg = GenerationConfig(24, SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=7),
                           stop_at_eos=False)
    prompts = [tok.encode("sample"), tok.encode("sample me too")]
    assert outcome(ahead, tok, prompts, cfg) == outcome(stepwise, tok, prompts, cfg)


def test_chat_on_the_pipe_keeps_exact_cache_lengths():
    ahead, stepwise = engines("smol-like", "fp16")
    tok = Tokenizer.byte_fallback(CONFIGS["smol-like"].vocab_size)
    got = []
    for eng in (ahead, stepwise):
        chat = ChatSession(eng, tok, GenerationConfig(7, GREEDY, stop_at_eos=False), system="sys", max_len=256)
        got.append([chat.send(m).text for m in ("hello", "again", "more")] + [list(chat.cached_ids)])
        assert int(chat.cache.lengths[0]) == len(chat.cached_ids)
    assert got[0] == got[1]


def test_leading_rows_of_a_large_cache_run_the_small_graph():
    """Slot 0 of a 32-row cache decodes on the batch-1 graph (a view of the same storage); a request joining slot 5
    moves the pipe to the 8-row graph; both rows' tokens equal each run alone."""
    from model_zoo.decode_pipe import open_pipe

    eng, _ = engines("gqa4-d64", "awq")
    V = CONFIGS["gqa4-d64"].vocab_size
    prompts = {0: [5, 9, 11, 13], 5: [7, 3, 2, 8, 100, 4]}
    alone = {r: generate(eng, Tokenizer.byte_fallback(V), [p], GenerationConfig(12, GREEDY, stop_at_eos=False))[0][0]
             .tokens for r, p in prompts.items()}
    cache = eng.new_cache(32, 64)
    sampler = eng.make_sampler(GREEDY, 32)
    pipe = open_pipe(eng, cache, sampler)

    def prefill(r):
        pipe.set_length(r, 0)
        logits = eng.forward(torch.tensor([prompts[r]]), cache, torch.tensor([r]))[:, -1]
        first = int(sampler.sample(logits, [r])[0])
        pipe.join(r, first, len(prompts[r]))
        return [first]

    got = {0: prefill(0)}
    for _ in range(4):
        got[0] += pipe.launch().tokens()
    assert set(cache.views) == {1}  # only the 1-row view has run
    got[5] = prefill(5)
    for _ in range(11):
        step = pipe.launch()
        for r, t in zip(step.rows, step.tokens()):
            got[r].append(t)
    assert 8 in cache.views and got[0][:12] == alone[0] and got[5][:12] == alone[5]


def test_warm_up_captures_the_request_graph_and_changes_no_token():
    """After warm_up (fllama generate / chat before the first request) the request's cache and its decode graph are
    the ones the warm-up made, so the request captures nothing; its tokens are those of a run without it."""
    from model_zoo.warm_up import warm_up

    eng, stepwise = engines("smol-like", "awq")
    tok = Tokenizer.byte_fallback(CONFIGS["smol-like"].vocab_size)
    prompts = [tok.encode("warm the engine up"), tok.encode("and a second row")]
    cfg = GenerationConfig(16, SamplingConfig(temperature=0.8, top_k=30, seed=11), stop_at_eos=False)
    want = [r.tokens for r in generate(stepwise, tok, prompts, cfg)[0]]
    assert warm_up(eng, tok, prompts, cfg) > 0.0
    cache = eng.new_cache(2, max(len(p) for p in prompts) + 16)
    graphs = dict(cache.graphs)
    assert "sampled" in graphs and int(cache.lengths.sum()) == 0
    assert [r.tokens for r in generate(eng, tok, prompts, cfg)[0]] == want
    assert eng.new_cache(2, 8).graphs["sampled"] is graphs["sampled"]  # the request captured no graph of its own
    chat = ChatSession(eng, tok, GenerationConfig(6, GREEDY, stop_at_eos=False), max_len=128)
    assert chat.warm_up() > 0.0 and int(chat.cache.lengths[0]) == 0
    assert chat.send("hi").text == ChatSession(stepwise, tok, chat.cfg, max_len=128).send("hi").text


def test_a_scheduler_warms_up_every_bucket_before_its_first_request():
    """`fllama serve`'s scheduler, before its first request: prefills and a draw load their kernels and the pipe
    captures the decode graph of each bucket of leading rows its 8 slots may decode as (1, 2, 4, 8), so no request
    stalls the others while one is captured; the slot it used then serves a request as if fresh."""
    import time

    from kernels_cu import cuda_context
    from kernels_cu.engine.config import BUCKETS
    from model_zoo.scheduler import Scheduler, SchedulerConfig
    from model_zoo.ticket import GenRequest

    eng, stepwise = engines("gqa4-d64", "awq")
    tok = Tokenizer.byte_fallback(CONFIGS["gqa4-d64"].vocab_size)
    prompt = tok.encode("after the warm-up")
    want = generate(stepwise, tok, [prompt], GenerationConfig(12, GREEDY, stop_at_eos=False))[0][0].tokens
    s = Scheduler(eng, tok, SchedulerConfig(max_batch=8, max_context=128, prefill_chunk=32),
                  thread_hooks=cuda_context.thread_hooks()).start()
    try:
        deadline = time.monotonic() + 120
        while s.warm_up_s is None:
            assert time.monotonic() < deadline and s.alive, "no warm-up"
            time.sleep(0.02)
        assert s.warm_up_error is None, s.warm_up_error
        cache = s.cache
        for m in (b for b in BUCKETS if b <= cache.bucket):
            assert (cache if m == cache.bucket else cache.views[m]).graphs.get("sampled") is not None, m
        assert cache.lengths.tolist() == [0] * 8
        t = s.submit(GenRequest(tuple(prompt), 12, GREEDY, stop_at_eos=False))
        assert t.wait(60) and t.tokens == want
    finally:
        s.close()
