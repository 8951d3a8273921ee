"""Chat sessions keep the KV cache between turns; the cached logits equal a fresh prefill."""

import torch

from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig
from model_zoo.sampling import SamplingConfig
from tests.helpers import byte_tokenizer, rel_err, tiny_model


def test_two_turns_reuse_equals_fresh_prefill():
    model, tok = tiny_model(11), byte_tokenizer()
    cfg = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    chat = ChatSession(model, tok, cfg, system="be brief", max_len=256)
    chat.send("hi there")
    first_len = int(chat.cache.lengths[0])
    chat.send("and again")
    assert int(chat.cache.lengths[0]) > first_len
    probe = torch.tensor([[42]])
    cached = model.forward(probe, chat.cache, torch.tensor([0]))[0, -1]
    fresh = model.forward(torch.tensor([chat.cached_ids + [42]]))[0, -1]
    assert rel_err(cached, fresh) < 1e-5


def test_reset_empties_the_cache():
    model, tok = tiny_model(12), byte_tokenizer()
    cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    chat = ChatSession(model, tok, cfg, max_len=256)
    chat.send("one")
    chat.reset()
    assert int(chat.cache.lengths[0]) == 0 and chat.cached_ids == [] and chat.messages == []
