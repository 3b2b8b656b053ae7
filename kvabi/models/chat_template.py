"""A model's Jinja chat template, rendered the way HF transformers renders it.

Same environment as `transformers.utils.chat_template_utils`: sandboxed, `trim_blocks` and
`lstrip_blocks`, loop controls, a `tojson` that does not HTML-escape, `raise_exception` and
`strftime_now`; the special tokens (`bos_token`, `eos_token`, ...) are template variables.
Not supported: the `{% generation %}` tag (assistant-token masks) and `continue_final_message`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """`render(messages, add_generation_prompt)` -> the prompt text the model was tuned on."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        variables = {**self.special_tokens, **kwargs}
        return self._template.render(
            messages=[dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


# Gemma's turn format, for GGUFs of arch gemma3 that carry no `tokenizer.chat_template` (the
# bundled gemma3-270m): `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`, the assistant
# role written `model`, a system message folded into the first user turn, and a generation
# prompt of `<start_of_turn>model\n`. Written here from the format, not copied.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{% set system = '' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] ~ '\n\n' %}"
    "{% set messages = messages[1:] %}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{% if role not in ('user', 'model') %}"
    "{{ raise_exception('Gemma turns: roles are system (first), user and assistant') }}"
    "{% endif %}"
    "<start_of_turn>{{ role }}\n{{ (system if loop.first else '') ~ m['content'] | trim }}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
DEFAULT_TEMPLATES = {"gemma3": GEMMA_TURNS}  # GGUF arch -> template when the file has none
