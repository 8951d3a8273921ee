"""Ctrl-C in the middle of a chat reply on the GPU engine: the session goes on with a consistent KV cache."""

from __future__ import annotations

import pytest
import torch

from model_zoo.chat import ChatSession
from model_zoo.generation import GenerationConfig
from model_zoo.sampling import SamplingConfig
from model_zoo.tokenizer import Tokenizer
from tests.gpu.test_engine import CONFIGS, engine_and_ref, rel

pytestmark = pytest.mark.gpu


def test_an_interrupted_reply_leaves_the_engine_cache_consistent():
    config = CONFIGS["smol-like"]
    eng, _ = engine_and_ref(config, "fp16")
    tok = Tokenizer.byte_fallback(config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    chat = ChatSession(eng, tok, cfg, system="sys", max_len=256)
    chat.send("hello")
    pieces = []

    def interrupt(_row, text):
        pieces.append(text)
        if len(pieces) == 4:  # as Ctrl-C would, between two decode steps
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        chat.send("tell me more", on_text=interrupt)
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    assert int(chat.cache.lengths[0]) == len(chat.cached_ids)
    chat.send("again")
    cached = eng.forward(torch.tensor([[42]]), chat.cache, torch.tensor([0]))[0, -1]
    fresh = eng.forward(torch.tensor([chat.cached_ids + [42]]))[0, -1]
    assert int(chat.cache.lengths[0]) == len(chat.cached_ids) + 1 and rel(cached, fresh) < 1e-2
