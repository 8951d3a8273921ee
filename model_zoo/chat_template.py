"""Chat templates: render a conversation to the prompt text a chat model was trained on.

Templates are Jinja, rendered in a sandbox the way transformers' apply_chat_template does (trim_blocks,
lstrip_blocks, loopcontrols, raise_exception, strftime_now, a tojson that keeps non-ASCII), so a model's own
template gives the same text here as there. Source of the template: the model's (tokenizer_config.json,
chat_template.jinja, GGUF tokenizer.chat_template), else a built-in fallback chosen by default_template.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model_zoo.errors import PromptError

if TYPE_CHECKING:
    from model_zoo.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta's LLaMA-2 chat format: <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] ...
# The prompt always ends after [/INST], so add_generation_prompt changes nothing.
LLAMA2_TEMPLATE = """\
{% if messages and messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}
{% else %}
{% set system = '' %}{% set turns = messages %}
{% endif %}
{% for m in turns %}
{% if (m['role'] == 'user') != (loop.index0 is even) %}
{{ raise_exception('LLaMA-2 chat needs user and assistant turns alternating, starting with user') -}}
{% endif %}
{% if m['role'] == 'user' %}
{% set text = ('<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + m['content']) if loop.first and system else m['content'] %}
{{ bos_token + '[INST] ' + text | trim + ' [/INST]' -}}
{% else %}
{{ ' ' + m['content'] | trim + ' ' + eos_token -}}
{% endif %}
{% endfor %}
"""


# Meta-Llama-3-8B-Instruct's template: <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
# per message; the turn ends at <|eot_id|> (128009), one of the model's stop ids.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the conversation does not fit the template's rules."""


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str | None,
                eos_token: str | None, add_generation_prompt: bool = True, **extra: Any) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]); template None means ChatML."""
    _check_messages(messages)
    try:
        compiled = _compile(template if template is not None else CHATML_TEMPLATE)
        return compiled.render(messages=[dict(m) for m in messages], bos_token=bos_token or "",
                               eos_token=eos_token or "", add_generation_prompt=add_generation_prompt, **extra)
    except _TemplateRaised as e:
        raise PromptError(f"the chat template refused the conversation: {e}") from None
    except jinja2.TemplateError as e:
        raise PromptError(f"the chat template cannot be rendered ({type(e).__name__}: {e})") from None


def default_template(tokenizer: "Tokenizer") -> str:
    """The built-in template for a model without one: ChatML when the vocabulary has <|im_start|>, Llama-3's when
    it has <|start_header_id|>, else LLaMA-2's [INST]."""
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return CHATML_TEMPLATE
    return LLAMA3_TEMPLATE if tokenizer.token_to_id("<|start_header_id|>") is not None else LLAMA2_TEMPLATE


def apply_chat_template(tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True) -> str:
    """Render with the model's own template, or the fallback default_template picks."""
    template = tokenizer.chat_template or default_template(tokenizer)
    return render_chat(template, messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                       add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids for a conversation; the template writes BOS itself, so nothing more is added."""
    return tokenizer.encode(apply_chat_template(tokenizer, messages, add_generation_prompt),
                            add_special_tokens=False)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise PromptError("the conversation is empty")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise PromptError(f"message {k} must be a mapping with 'role' and 'content', got {m!r}")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
