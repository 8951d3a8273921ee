"""The generation loop with decode steps run ahead of the host: what a row decodes past its end is dropped exactly,
and its cache length counts only what it was fed (a StepPipe launched `depth` steps ahead behaves as the GPU's)."""

import pytest
import torch

from model_zoo import decode_pipe
from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from tests.helpers import EosTokenizer, byte_tokenizer, tiny_model

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture
def ahead(monkeypatch):
    """Pipes that keep 4 steps in flight: rows decode up to 3 steps past an end the loop has not read yet."""
    monkeypatch.setattr(decode_pipe.StepPipe, "depth", 4)


def outcome(model, tok, prompts, **kw):
    cfg = GenerationConfig(**{"max_new_tokens": 12, "sampling": GREEDY, **kw})
    cache = model.new_cache(len(prompts), 64)
    pieces: list[tuple[int, str]] = []
    res, stats = generate(model, tok, prompts, cfg, on_text=lambda r, t: pieces.append((r, t)), cache=cache)
    return [(r.tokens, r.text, r.finish_reason) for r in res], pieces, cache.lengths.tolist(), stats.generated_tokens


def test_run_ahead_gives_the_step_by_step_results(monkeypatch):
    model, base = tiny_model(3), byte_tokenizer()
    prompts = [base.encode("xyz"), base.encode("a longer prompt"), base.encode("q")]
    free = generate(model, base, prompts[:1], GenerationConfig(12, GREEDY, stop_at_eos=False))[0][0]
    eos_tok = EosTokenizer(base, {free.tokens[4]})
    cases = [dict(tok=base, stop_at_eos=False), dict(tok=eos_tok), dict(tok=base, stop_strings=(free.text[2:4],)),
             dict(tok=base, stop_at_eos=False, max_new_tokens=3)]
    for case in cases:
        tok = case.pop("tok")
        want = outcome(model, tok, prompts, **case)
        with monkeypatch.context() as m:
            m.setattr(decode_pipe.StepPipe, "depth", 4)
            got = outcome(model, tok, prompts, **case)
        assert got == want, case
    assert "eos" in {finish for _, _, finish in outcome(model, eos_tok, prompts)[0]}  # the EOS case does end one


def test_a_row_ending_early_does_not_disturb_the_others(ahead):
    model, base = tiny_model(5), byte_tokenizer()
    prompts = [base.encode("abc"), base.encode("defgh")]
    alone = [generate(model, base, [p], GenerationConfig(10, GREEDY, stop_at_eos=False))[0][0].tokens for p in prompts]
    tok = EosTokenizer(base, {alone[0][2]})  # row 0 ends at its third token, row 1 goes on
    got = generate(model, tok, prompts, GenerationConfig(10, GREEDY))[0]
    assert got[0].finish_reason == "eos" and got[0].tokens == alone[0][:alone[0].index(alone[0][2])]
    if alone[0][2] not in alone[1]:
        assert got[1].tokens == alone[1]


def test_chat_turns_continue_the_exact_cache(ahead, monkeypatch):
    model, tok = tiny_model(6), byte_tokenizer()
    cfg = GenerationConfig(6, GREEDY, stop_at_eos=False)
    replies = []
    for depth in (1, 4):
        monkeypatch.setattr(decode_pipe.StepPipe, "depth", depth)
        chat = ChatSession(model, tok, cfg, max_len=256)
        replies.append([chat.send(m).text for m in ("hi", "and then?", "ok")] + [int(chat.cache.lengths[0])])
    assert replies[0] == replies[1]


def test_a_full_cache_is_refused_before_a_step_writes_past_it():
    model, tok = tiny_model(1), byte_tokenizer()
    cache = model.new_cache(1, 8)
    pipe = decode_pipe.StepPipe(model, cache, None)
    pipe.join(0, 1, 8)
    with pytest.raises(Exception, match="row 0 is full"):
        pipe.launch()


def test_lengths_are_set_back_only_where_steps_ran_past_an_end(ahead, monkeypatch):
    """A row that took every token its steps sampled already has the right length: no set_length (on the GPU a
    stream write and two event waits per row); a row that ended with steps in flight is set back."""
    model, base = tiny_model(3), byte_tokenizer()
    prompts = [base.encode("xyz"), base.encode("a longer prompt")]
    free = generate(model, base, prompts[:1], GenerationConfig(12, GREEDY, stop_at_eos=False))[0][0]
    calls: list[tuple[int, int]] = []
    set_length = decode_pipe.StepPipe.set_length
    monkeypatch.setattr(decode_pipe.StepPipe, "set_length",
                        lambda self, row, n: (calls.append((row, n)), set_length(self, row, n))[1])
    lengths = outcome(model, base, prompts, stop_at_eos=False)[2]
    assert calls == [] and lengths == [len(p) + 12 - 1 for p in prompts]
    _, _, lengths, _ = outcome(model, EosTokenizer(base, {free.tokens[4]}), prompts)
    assert calls and all(lengths[r] == n for r, n in calls) and lengths[0] == len(prompts[0]) + 4
