"""`kvabi serve` on the bundled SmolLM2 with the `openai` client: its chat template, real answers.

The server loads the model (about 30 s here) while this process reads the GGUF's tokenizer, the
reference for the prompt token counts.
"""

from __future__ import annotations

import pytest

from kvabi.models.tokenizer import Tokenizer
from kvabi.server.launch import ServerProcess
from tests.conftest import bundled_gguf_path

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def served():
    path = bundled_gguf_path()
    server = ServerProcess(["--log-level", "warning"], startup_timeout_s=300).start()
    try:
        tokenizer = Tokenizer.from_gguf(path)
        server.wait_ready()
        yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0), tokenizer
    finally:
        server.stop()


def test_chat_uses_the_models_template_and_answers(served):
    client, tokenizer = served
    whole = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=16, temperature=0
    )
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completion_counts_the_tokenizers_tokens(served):
    client, tokenizer = served
    prompt = "The capital of France is"
    out = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=4, temperature=0
    )
    assert out.choices[0].text.startswith(" Paris")
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
