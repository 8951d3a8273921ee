"""The generation loop on the reference backend: batching, stops, seeds, budgets."""

import pytest
import torch

from model_zoo.errors import ConfigError, PromptError
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from tests.helpers import EosTokenizer, byte_tokenizer, tiny_model

GREEDY = SamplingConfig(temperature=0)


def run(model, tok, prompts, **kw):
    cfg = GenerationConfig(**{"max_new_tokens": 12, "sampling": GREEDY, **kw})
    return generate(model, tok, prompts, cfg)[0]


def test_ragged_batch_equals_each_prompt_alone():
    model, tok = tiny_model(1), byte_tokenizer()
    prompts = [tok.encode("a"), tok.encode("a longer prompt here"), tok.encode("mid size")]
    batch = run(model, tok, prompts, stop_at_eos=False)
    for p, row in zip(prompts, batch):
        alone = run(model, tok, [p], stop_at_eos=False)[0]
        assert row.tokens == alone.tokens and len(row.tokens) == 12
        assert row.finish_reason == "length"


def test_greedy_tokens_follow_argmax_of_full_forward():
    model, tok = tiny_model(2), byte_tokenizer()
    prompt = tok.encode("hello")
    out = run(model, tok, [prompt], stop_at_eos=False)[0].tokens
    seq = list(prompt)
    for t in out:  # recompute each step without any cache
        assert int(model.forward(torch.tensor([seq]))[0, -1].argmax()) == t
        seq.append(t)


def test_stop_at_eos_and_stop_string():
    model, base = tiny_model(3), byte_tokenizer()
    prompt = base.encode("xyz")
    free = run(model, base, [prompt], stop_at_eos=False)[0]
    eos = free.tokens[4]
    first = free.tokens.index(eos)
    stopped = run(model, EosTokenizer(base, {eos}), [prompt])[0]
    assert stopped.finish_reason == "eos" and stopped.tokens == free.tokens[:first]
    text = free.text
    needle = text[3:5]
    cut = run(model, base, [prompt], stop_at_eos=False, stop_strings=(needle,))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(needle)]


def test_streamed_text_equals_final_text():
    model, tok = tiny_model(4), byte_tokenizer()
    pieces = []
    cfg = GenerationConfig(max_new_tokens=10, sampling=GREEDY, stop_at_eos=False)
    res, stats = generate(model, tok, [tok.encode("stream")], cfg, on_text=lambda r, t: pieces.append(t))
    assert "".join(pieces) == res[0].text
    assert stats.generated_tokens == 10 and stats.prompt_tokens == len(tok.encode("stream"))


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    model, tok = tiny_model(5), byte_tokenizer()
    p = [tok.encode("seed")]
    samp = lambda s: GenerationConfig(max_new_tokens=16, stop_at_eos=False,
                                      sampling=SamplingConfig(temperature=1.5, top_k=0, top_p=1.0, seed=s))
    a = generate(model, tok, p, samp(7))[0][0].tokens
    b = generate(model, tok, p, samp(7))[0][0].tokens
    c = generate(model, tok, p, samp(8))[0][0].tokens
    assert a == b and a != c


def test_budget_is_capped_by_the_context():
    model, tok = tiny_model(6), byte_tokenizer()
    prompt = list(range(3, 3 + 250))  # context is 256
    res = run(model, tok, [prompt], stop_at_eos=False, max_new_tokens=50)[0]
    assert len(res.tokens) == 256 - 250 and res.finish_reason == "length"


def test_prompt_errors():
    model, tok = tiny_model(), byte_tokenizer()
    with pytest.raises(PromptError, match="empty"):
        run(model, tok, [[]])
    with pytest.raises(PromptError, match="context"):
        run(model, tok, [list(range(3, 3 + 256))])
    with pytest.raises(ConfigError):
        GenerationConfig(max_new_tokens=0)
