"""The continuous-batching scheduler without HTTP, on the tiny reference model: each request gets what generate()
gives it alone (greedy, seeded, stops, EOS, budgets), however many share the batch, whichever slot it gets, with
results read one or three steps late."""

from __future__ import annotations

import pytest

from model_zoo.decode_pipe import StepPipe
from model_zoo.errors import ConfigError, PromptError
from model_zoo.cpu_fast import CpuModel
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from model_zoo.scheduler import Scheduler, SchedulerConfig
from model_zoo.text_stream import TextStream
from model_zoo.ticket import GenRequest, Overloaded, Unavailable
from tests._serve_helpers import assert_same_greedy
from tests.helpers import EosTokenizer, byte_tokenizer, tiny_model

GREEDY = SamplingConfig(temperature=0.0)
HOT = SamplingConfig(temperature=1.2, top_k=0, top_p=1.0)
# the CPU backend on one thread: the scheduler's thread gets its own OpenMP team, which on a busy machine
# would fight the main thread's for the cores
MODEL, TOK = CpuModel(tiny_model(3).weights, threads=1), byte_tokenizer()
TEXTS = ["hello", "a longer prompt than the others", "x", "abc def", "the end of the", "zz top", "q", "lorem ip"]


class LatePipe(StepPipe):
    """A StepPipe whose loop keeps `depth` steps in flight, as the GPU engine's does: results arrive late, rows
    decode past their end."""

    def __init__(self, backend, cache, sampler, depth: int):
        super().__init__(backend, cache, sampler)
        self.depth = depth


class Late:
    """The tiny model with a decode pipe `depth` steps deep."""

    def __init__(self, model, depth: int):
        self._m, self._depth = model, depth

    def decode_pipe(self, cache, sampler):
        return LatePipe(self._m, cache, sampler, self._depth)

    def __getattr__(self, name):
        return getattr(self._m, name)


def alone(prompt, n, sampling=GREEDY, stops=(), eos=False):
    cfg = GenerationConfig(max_new_tokens=n, sampling=sampling, stop_strings=tuple(stops), stop_at_eos=eos)
    return generate(MODEL, TOK, [prompt], cfg)[0][0]


@pytest.fixture
def sched(request):
    """A started scheduler; parametrize indirectly with (backend depth, SchedulerConfig kwargs)."""
    depth, kw = getattr(request, "param", (1, {}))
    s = Scheduler(MODEL if depth == 1 else Late(MODEL, depth), TOK,
                  SchedulerConfig(**{"max_batch": 4, "max_context": 200, **kw})).start()
    yield s
    s.close()


@pytest.mark.parametrize("sched", [(1, {}), (3, {"prefill_chunk": 5})], indirect=True)
def test_more_requests_than_slots_each_as_alone(sched):
    prompts = [TOK.encode(t) for t in TEXTS]
    budgets = [12, 30, 7, 20, 1, 16, 25, 9]
    tickets = [sched.submit(GenRequest(tuple(p), n, GREEDY, stop_at_eos=False)) for p, n in zip(prompts, budgets)]
    for p, n, t in zip(prompts, budgets, tickets):
        assert t.wait(60)
        want = alone(p, n)
        assert_same_greedy(MODEL, p, t.tokens, want.tokens)
        assert t.finish_reason == "length" and (t.text == want.text or t.tokens != want.tokens)
        assert t.usage.completion_tokens == n and t.usage.prompt_tokens == len(p)
    assert sched.load()["free_slots"] == 4


@pytest.mark.parametrize("sched", [(3, {})], indirect=True)
def test_stop_strings_and_eos_end_exactly_when_results_come_late(sched):
    p = TOK.encode("stop here")
    free = alone(p, 40)
    stop = free.text[9:12]  # text the reply will contain
    want = alone(p, 40, stops=[stop])
    t = sched.submit(GenRequest(tuple(p), 40, GREEDY, stop=(stop,), stop_at_eos=False))
    pieces, done = [], False
    while not done:
        text, done = t.take(5)
        pieces.append(text)
    assert t.finish_reason == "stop" and t.text == want.text and t.tokens == want.tokens
    assert "".join(pieces) == want.text and stop not in t.text

    k = next(i for i in range(3, 40) if free.tokens[i] not in free.tokens[:i])  # a token's first appearance
    eos_tok = EosTokenizer(TOK, {free.tokens[k]})
    s2 = Scheduler(Late(MODEL, 3), eos_tok, SchedulerConfig(max_batch=2, max_context=200)).start()
    try:
        t2 = s2.submit(GenRequest(tuple(p), 40, GREEDY))
        assert t2.wait(30)
        assert t2.finish_reason == "eos" and t2.tokens == free.tokens[:k]
        assert t2.usage.completion_tokens == k + 1  # the end-of-sequence token counts
    finally:
        s2.close()


def test_a_seeded_request_draws_the_same_tokens_in_any_slot(sched):
    p = TOK.encode("seed me")
    seeded = SamplingConfig(temperature=1.2, top_k=0, top_p=1.0, seed=1234)
    want = alone(p, 20, sampling=seeded).tokens
    first = sched.submit(GenRequest(tuple(p), 20, seeded, stop_at_eos=False))
    assert first.wait(30) and first.tokens == want
    busy = [sched.submit(GenRequest(tuple(TOK.encode(t)), 60, HOT, stop_at_eos=False)) for t in TEXTS[:3]]
    late = sched.submit(GenRequest(tuple(p), 20, seeded, stop_at_eos=False))  # slot 3, beside sampled rows
    assert late.wait(60) and late.tokens == want and all(b.wait(60) for b in busy)


def test_lowest_free_slot_and_cancel_frees_it(sched):
    long = sched.submit(GenRequest(tuple(TOK.encode("long one")), 150, GREEDY, stop_at_eos=False))
    text, done = long.take(10)
    assert text and not done and long.slot == 0
    second = sched.submit(GenRequest(tuple(TOK.encode("b")), 150, GREEDY, stop_at_eos=False))
    second.take(10)
    assert second.slot == 1
    long.cancel()
    assert long.wait(10) and long.finish_reason == "cancelled" and long.slot == -1
    third = sched.submit(GenRequest(tuple(TOK.encode("c")), 150, GREEDY, stop_at_eos=False))
    third.take(10)
    assert third.slot == 0  # the lowest free slot
    for t in (second, third):
        t.cancel()
        assert t.wait(10) and t.finish_reason == "cancelled"
    assert sched.load() == {"max_batch": 4, "running": 0, "waiting": 0, "free_slots": 4, "max_context": 200,
                            "warming_up": False}  # the CPU backend has no warm-up


def test_bad_requests_are_refused_at_submit(sched):
    for req, needle in ((GenRequest(()), "empty"),
                        (GenRequest(tuple(range(3, 203))), "context holds 200"),
                        (GenRequest((5, 6, 7), max_tokens=198), "lower max_tokens to 197"),
                        (GenRequest((5, 999)), "vocabulary")):
        with pytest.raises(PromptError, match=needle):
            sched.submit(req)
    with pytest.raises(ConfigError):
        GenRequest((5,), stop=("",))
    ok = sched.submit(GenRequest((5, 6, 7), max_tokens=197, sampling=GREEDY, stop_at_eos=False))
    assert ok.wait(30) and len(ok.tokens) == 197  # prompt + reply fill the slot exactly


@pytest.mark.parametrize("sched", [(1, {"max_batch": 1, "max_queue": 1})], indirect=True)
def test_a_full_queue_is_overloaded_and_a_closed_scheduler_unavailable(sched):
    running = sched.submit(GenRequest((5, 6), 150, GREEDY, stop_at_eos=False))
    running.take(10)
    queued = sched.submit(GenRequest((5, 7), 5, GREEDY))
    with pytest.raises(Overloaded):
        sched.submit(GenRequest((5, 8), 5, GREEDY))
    sched.close()
    assert running.wait(5) and running.finish_reason == "error" and isinstance(running.error, Unavailable)
    assert queued.wait(5) and queued.finish_reason == "error"
    with pytest.raises(Unavailable):
        sched.submit(GenRequest((5, 9), 5, GREEDY))


def test_a_failing_prefill_fails_its_request_only(sched, monkeypatch):
    real = MODEL.forward

    def flaky(tokens, cache=None, rows=None, **kw):
        if bool((tokens == 99).any()):
            raise RuntimeError("boom")
        return real(tokens, cache, rows, **kw)

    monkeypatch.setattr(MODEL, "forward", flaky)
    with sched._cv:  # both admitted in one turn: one prefill call of two rows fails, then each runs alone
        bad = sched.submit(GenRequest((5, 99, 7), 5, GREEDY))
        good = sched.submit(GenRequest((5, 6, 8), 5, GREEDY, stop_at_eos=False))
    assert bad.wait(10) and good.wait(10)
    assert bad.finish_reason == "error" and "boom" in str(bad.error)
    assert good.finish_reason == "length" and sched.alive


def test_text_stream_holds_back_a_possible_stop():
    shown = []
    s = TextStream(TOK, 50, stop_strings=("END",), on_text=shown.append)
    for ch in TOK.encode("abEN", add_special_tokens=False):
        assert not s.push(ch)
    assert "".join(shown) == "ab"  # "EN" could start "END"
    for ch in TOK.encode("D!", add_special_tokens=False):
        if s.push(ch):
            break
    assert s.finish_reason == "stop" and s.text == "ab" and "".join(shown) == "ab"


def test_a_failing_decode_step_fails_its_batch_and_the_next_request_runs():
    class Flaky(Late):
        fails = 1

        def decode_pipe(self, cache, sampler):
            pipe = super().decode_pipe(cache, sampler)
            launch = pipe.launch

            def flaky_launch():
                if Flaky.fails:
                    Flaky.fails -= 1
                    raise RuntimeError("device lost")
                return launch()

            pipe.launch = flaky_launch
            return pipe

    s = Scheduler(Flaky(MODEL, 2), TOK, SchedulerConfig(max_batch=2, max_context=64)).start()
    try:
        lost = s.submit(GenRequest((5, 6), 10, GREEDY, stop_at_eos=False))
        assert lost.wait(10) and lost.finish_reason == "error" and "device lost" in str(lost.error)
        ok = s.submit(GenRequest((5, 6), 10, GREEDY, stop_at_eos=False))
        assert ok.wait(10) and ok.finish_reason == "length" and ok.tokens == alone([5, 6], 10).tokens
        assert s.alive and s.load()["free_slots"] == 2
    finally:
        s.close()


def test_torch_sampler_rows_keep_their_own_settings_and_seed():
    import torch

    from model_zoo.sampling import TorchSampler, row_seed

    V = 50
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).repeat(3, 1)  # [3, V]
    mine = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, seed=9)
    a = TorchSampler(GREEDY, 3, V)
    a.configure_row(0, mine)
    b = TorchSampler(SamplingConfig(temperature=0.5, seed=1), 3, V)
    b.configure_row(2, mine)
    draws_a = [a.sample(logits, [0, 1, 2]).tolist() for _ in range(12)]
    draws_b = [b.sample(logits[:1], [2]).tolist() for _ in range(12)]
    assert [d[0] for d in draws_a] == [d[0] for d in draws_b]  # slot 0 in one batch, slot 2 alone
    assert len({d[0] for d in draws_a}) > 2 and {d[1] for d in draws_a} == {int(logits[0].argmax())}
    assert row_seed(9, 0) == 9 and row_seed(9, 1) != row_seed(9, 2)


class WarmPipe(LatePipe):
    """A LatePipe that captures graphs, as the GPU engine's does: warm_up() records what ran before it (or fails)."""

    def __init__(self, backend, cache, sampler, log: list, fail: bool):
        super().__init__(backend, cache, sampler, 2)
        self.log, self.fail = log, fail

    def warm_up(self):
        self.log.append(("warm_up", [int(n) for n in self.cache.lengths]))
        if self.fail:
            raise RuntimeError("out of memory")


@pytest.mark.parametrize("fail", [False, True])
def test_warm_up_runs_before_the_first_request_and_leaves_no_trace(fail, monkeypatch):
    log = []

    class Warm(Late):
        def decode_pipe(self, cache, sampler):
            return WarmPipe(self._m, cache, sampler, log, fail)

    real = MODEL.forward

    def logged(tokens, cache=None, rows=None, **kw):
        log.append(("forward", tuple(tokens.shape)))
        return real(tokens, cache, rows, **kw)

    monkeypatch.setattr(MODEL, "forward", logged)
    p = TOK.encode("warm")
    want = alone(p, 12)  # before the log counts: generate() prefills too
    log.clear()
    s = Scheduler(Warm(MODEL, 2), TOK, SchedulerConfig(max_batch=2, max_context=64, prefill_chunk=16))
    first_pipe = s.pipe
    assert s.load()["warming_up"]  # /health says so from the start
    s.start()
    try:
        t = s.submit(GenRequest(tuple(p), 12, GREEDY, stop_at_eos=False))
        assert t.wait(30) and t.tokens == want.tokens  # in slot 0, which the warm-up used, as alone
        # each size class of prefill (up to a whole chunk, 16 here) into slot 0, its length put back, then the graphs
        assert log[:3] == [("forward", (1, 8)), ("forward", (1, 16)), ("warm_up", [0, 0])]
        assert log[3] == ("forward", (1, len(p)))  # the request's own prefill comes after
        assert s.warm_up_s is not None and s.warm_up_s >= 0 and not s.load()["warming_up"]
        assert (s.warm_up_error is not None) == fail and s.alive
        assert (s.pipe is not first_pipe) == fail  # after a failed warm-up a fresh pipe took over, and served
    finally:
        s.close()
