"""Gemma's turn format, the chat template of a gemma3 GGUF that carries none."""

from __future__ import annotations

import pytest
from jinja2.exceptions import TemplateError

from kvabi.models.chat_template import DEFAULT_TEMPLATES, GEMMA_TURNS, ChatTemplate

TEMPLATE = ChatTemplate(GEMMA_TURNS, {"bos_token": "<bos>"})


def test_turns_fold_the_system_message_and_name_the_assistant_model() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert TEMPLATE.render(messages, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    one = [{"role": "user", "content": "Hi"}]
    assert TEMPLATE.render(one) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    assert DEFAULT_TEMPLATES["gemma3"] is GEMMA_TURNS


def test_an_unknown_role_is_an_error() -> None:
    with pytest.raises(TemplateError, match="roles are system"):
        TEMPLATE.render([{"role": "tool", "content": "{}"}])
