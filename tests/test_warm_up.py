"""warm_up: a short run before a request on backends with a pipe of their own; the request's results are unchanged."""

import pytest
import torch

from model_zoo import decode_pipe
from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig, generate
from model_zoo.sampling import SamplingConfig
from model_zoo.warm_up import warm_up
from tests.helpers import byte_tokenizer, tiny_model


class Piped:
    """The reference model with a `decode_pipe` (a StepPipe), as a backend that captures graphs would have; it
    records the shape of every forward."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, cache=None, rows=None, *, last=False):
        self.shapes.append(tuple(tokens.shape))
        return self.model.forward(tokens, cache, rows, last=last)

    def decode_pipe(self, cache, sampler):
        return decode_pipe.StepPipe(self, cache, sampler)


CONFIGS = [GenerationConfig(8, SamplingConfig(temperature=0), stop_at_eos=False),
           GenerationConfig(8, SamplingConfig(temperature=0.9, top_k=20, seed=3), stop_at_eos=False)]


def test_backends_without_graphs_are_left_alone():
    model, tok = Piped(tiny_model(1)), byte_tokenizer()
    model.decode_pipe = None  # the CPU backends: no pipe of their own
    assert warm_up(model, tok, [tok.encode("hello")], CONFIGS[0]) == 0.0
    assert model.shapes == []


@pytest.mark.parametrize("cfg", CONFIGS, ids=["greedy", "seeded"])
def test_the_request_after_a_warm_up_is_unchanged(cfg):
    tok = byte_tokenizer()
    prompts = [tok.encode("a prompt of some length"), tok.encode("two")]
    want = [r.tokens for r in generate(tiny_model(2), tok, prompts, cfg)[0]]
    model = Piped(tiny_model(2))
    assert warm_up(model, tok, prompts, cfg) > 0.0
    # each prompt cut below its length (a prefill shape seen twice would be captured by the request), 2 tokens
    assert model.shapes[:2] == [(1, len(prompts[0]) - 1), (1, len(prompts[1]) - 1)]
    assert len(model.shapes) == 3  # the two prefills and one decode step
    assert [r.tokens for r in generate(model, tok, prompts, cfg)[0]] == want


def test_long_prompts_are_cut_to_the_warm_up_length():
    model, tok = Piped(tiny_model(3)), byte_tokenizer()
    warm_up(model, tok, [tok.encode("much longer than five tokens"), tok.encode("x")], CONFIGS[0], max_prompt=5)
    assert model.shapes[:2] == [(1, 5), (1, 1)]  # a one-token prompt stays one token


def test_a_chat_session_warms_up_on_its_own_cache():
    tok, cfg = byte_tokenizer(), CONFIGS[1]
    replies = []
    for warm in (False, True):
        chat = ChatSession(Piped(tiny_model(4)), tok, cfg, system="be brief", max_len=256)
        if warm:
            assert chat.warm_up() > 0.0
            assert int(chat.cache.lengths[0]) == 0 and chat.cached_ids == []
        replies.append([chat.send(m).text for m in ("hi", "and then?")] + [int(chat.cache.lengths[0])])
    assert replies[0] == replies[1]


def test_a_failed_warm_up_leaves_the_cache_lengths_as_they_were():
    model, tok = Piped(tiny_model(5)), byte_tokenizer()
    cache = model.new_cache(1, 64)
    cache.lengths[0] = 7

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    model.decode_pipe = broken
    with pytest.raises(RuntimeError):
        warm_up(model, tok, [tok.encode("hello")], CONFIGS[0], cache=cache)
    assert cache.lengths.tolist() == [7]
    assert isinstance(cache.lengths, torch.Tensor)
