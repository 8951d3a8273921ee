"""forward(last=True): a prompt's prefill computes the final norm and the lm_head on each row's last position only
(what generation and the server read); evaluation keeps every position. The GPU engine's side is in
tests/gpu/test_fp8_fused.py."""

from __future__ import annotations

import torch

from kernels_cu.torch_baseline import StaticKVDecoder
from model_zoo.config import LlamaConfig
from model_zoo.cpu_fast import CpuModel
from model_zoo.generation import GenerationConfig, generate
from model_zoo.reference import ReferenceModel
from model_zoo.sampling import SamplingConfig
from model_zoo.weights import ModelWeights, random_state_dict
from tests.helpers import byte_tokenizer

CONFIG = LlamaConfig(64, 2, 4, 2, 128, 300, max_positions=64)


def weights() -> ModelWeights:
    return ModelWeights.from_state_dict(CONFIG, random_state_dict(CONFIG, seed=3))


def test_last_position_logits_of_the_reference_and_the_cpu_backend():
    w = weights()
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (ReferenceModel(w), CpuModel(w, threads=1)):
        full = model.forward(tokens)  # [2, 9, V]
        last = model.forward(tokens, last=True)
        assert last.shape == (2, 1, CONFIG.vocab_size)
        torch.testing.assert_close(last, full[:, -1:], rtol=1e-4, atol=1e-4)
        cache = model.new_cache(2, 16)  # with a cache, rows continuing at their lengths
        model.forward(tokens[:, :4], cache)
        torch.testing.assert_close(model.forward(tokens[:, 4:], cache, last=True), full[:, -1:], rtol=1e-3,
                                   atol=1e-3)
        assert model.forward(tokens[:, :1], model.new_cache(2, 4), last=True).shape == (2, 1, CONFIG.vocab_size)


def test_the_compiled_baseline_computes_the_last_position_too():
    w = weights()
    dec = StaticKVDecoder(w, 2, 16, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = dec(tokens, torch.arange(9))
        dec.reset()
        last = dec(tokens, torch.arange(9), last=True)
    assert last.shape == (2, 1, CONFIG.vocab_size)
    torch.testing.assert_close(last, full[:, -1:])


class Spy:
    """A backend that records the `last` each prefill asks for."""

    def __init__(self, model):
        self.model, self.asked = model, []
        self.name, self.config, self.device = "spy", model.config, model.device

    def new_cache(self, batch, max_len):
        return self.model.new_cache(batch, max_len)

    def forward(self, tokens, cache=None, rows=None, *, last=False):
        if tokens.shape[1] > 1:
            self.asked.append(last)
        return self.model.forward(tokens, cache, rows, last=last)


def test_generation_prefills_ask_for_the_last_position_only():
    spy = Spy(ReferenceModel(weights()))
    tok = byte_tokenizer(CONFIG.vocab_size)
    cfg = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=0), stop_at_eos=False)
    out = generate(spy, tok, [tok.encode("two prompts"), tok.encode("of bytes")], cfg)[0]
    assert spy.asked == [True, True] and all(len(r.tokens) == 3 for r in out)
