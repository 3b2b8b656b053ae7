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
