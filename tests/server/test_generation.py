"""Completions and chat in-process: outputs equal `LLM.generate`, streamed or not, exact usage."""

from __future__ import annotations

import pytest

from kvabi.engine.llm import LLM
from kvabi.engine.outputs import RequestOutput
from kvabi.engine.sampling_params import SamplingParams
from tests.server.tiny_server import MODEL, app_for, chat_loaded, sse_events, with_client

GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.from_loaded(chat_loaded(), fingerprint="tiny", block_size=4, num_blocks=256)


def _reference(llm: LLM, prompt: str | list[int], **params: object) -> RequestOutput:
    return llm.generate([prompt], SamplingParams(**params))[0]


def _post(path: str, body: dict) -> tuple[int, dict | str]:
    async def call(client):
        return await client.post(path, json=body)

    response = with_client(app_for(), call)
    is_stream = response.headers["content-type"].startswith("text/event-stream")
    return response.status_code, response.text if is_stream else response.json()


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def test_completion_is_the_engines_greedy_output_with_exact_usage(llm):
    ref = _reference(llm, "Hello there", max_tokens=9, **GREEDY)
    status, body = _post(
        "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 9, **GREEDY}
    )
    assert status == 200
    assert (body["object"], body["model"], body["id"][:5]) == ("text_completion", MODEL, "cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": ref.outputs[0].text, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == _usage(len(ref.prompt_token_ids), 9)


def test_a_token_id_prompt_is_taken_as_given(llm):
    ref = _reference(llm, [5, 6, 7, 8], max_tokens=4, **GREEDY)
    status, body = _post("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 4, **GREEDY})
    assert status == 200 and body["choices"][0]["text"] == ref.outputs[0].text
    assert body["usage"] == _usage(4, 4)


def test_stream_carries_the_same_text_for_each_of_n_seeded_choices(llm):
    params = {"max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 3, "ignore_eos": True}
    ref = _reference(llm, "once upon", **params)
    stream_opts = {"stream": True, "stream_options": {"include_usage": True}}
    status, body = _post("/v1/completions", {"prompt": "once upon", **params, **stream_opts})
    assert status == 200
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    texts, finishes = {0: "", 1: "", 2: ""}, []
    for chunk in chunks:
        assert chunk["usage"] is None and chunk["object"] == "text_completion"
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
            finishes += [(c["index"], c["finish_reason"])] if c["finish_reason"] else []
    assert texts == {c.index: c.text for c in ref.outputs}
    assert len({t for t in texts.values()}) > 1  # seeded per choice: not three copies
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]  # once each
    assert len(chunks) > 1  # as produced (steps a slow reader missed are merged), not at the end
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == _usage(
        len(ref.prompt_token_ids), 36
    )


def _stop_string(text: str) -> str:
    """Two ASCII characters from the middle of a greedy output (the tiny model's are random)."""
    for at in range(3, len(text) - 2):
        if text[at : at + 2].isascii():
            return text[at : at + 2]
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it_even_when_streamed(llm, stream):
    full = _reference(llm, "stop here", max_tokens=24, **GREEDY).outputs[0].text
    stop = _stop_string(full)
    body = {"prompt": "stop here", "max_tokens": 24, "stop": [stop, "\x00\x00"], **GREEDY}
    status, out = _post("/v1/completions", {**body, "stream": stream})
    assert status == 200
    if stream:  # held back until it could not be part of the stop string: nothing to take back
        chunks = [e for e in sse_events(out) if e != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        text, finish = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
    assert (text, finish) == (full[: full.find(stop)], "stop")


def test_completion_logprobs_are_the_models_and_cover_every_token(llm):
    ref = _reference(llm, "abc", max_tokens=5, logprobs=2, **GREEDY).outputs[0]
    status, body = _post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 5, "logprobs": 2, **GREEDY}
    )
    logprobs = body["choices"][0]["logprobs"]
    assert status == 200 and len(logprobs["tokens"]) == 5
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs])
    for top, chosen in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen)  # greedy = the top
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(5)]
    assert logprobs["text_offset"] == offsets


def test_chat_renders_the_template_and_answers_as_generate_does(llm):
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ref = _reference(llm, ids, max_tokens=7, **GREEDY)
    status, body = _post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 7, **GREEDY})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ref.outputs[0].text},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == _usage(len(ids), 7)


def test_chat_stream_opens_with_the_role_then_the_same_content(llm):
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ref = _reference(llm, ids, max_tokens=6, **GREEDY).outputs[0]
    body = {"messages": MESSAGES, "max_completion_tokens": 6, "stream": True, **GREEDY}
    status, out = _post("/v1/chat/completions", body)
    events = sse_events(out)
    assert status == 200 and events[-1] == "[DONE]"
    first, *rest = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in rest) == ref.text
    assert rest[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_list_each_token_with_its_alternatives(llm):
    body = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 3, **GREEDY}
    status, out = _post("/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 4
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)


def test_unset_max_tokens_defaults_to_16_for_completions_and_the_window_for_chat(llm):
    status, out = _post("/v1/completions", {"prompt": "x", **GREEDY})
    assert status == 200 and out["usage"]["completion_tokens"] == 16
    ids = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    status, out = _post("/v1/chat/completions", {"messages": MESSAGES, **GREEDY})
    window = llm.engine.info.max_model_len
    assert status == 200 and out["usage"]["total_tokens"] == window  # ran to the window's end
    assert out["choices"][0]["finish_reason"] == "length" and len(ids) < window


def test_models_and_health():
    async def calls(client):
        return [(await client.get(p)) for p in ("/v1/models", "/health")]

    models, health = with_client(app_for(), calls)
    assert models.json()["data"][0]["id"] == MODEL
    assert models.json()["data"][0]["max_model_len"] == 512
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


def test_chat_content_parts_are_joined_into_one_text(llm):
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    as_parts = [MESSAGES[0], {"role": "user", "content": parts}]
    body = {"max_tokens": 5, **GREEDY}
    _, joined = _post("/v1/chat/completions", {"messages": MESSAGES, **body})
    status, out = _post("/v1/chat/completions", {"messages": as_parts, **body})
    assert status == 200 and out["choices"] == joined["choices"]
    assert out["usage"] == joined["usage"]
