"""Bad input gets an OpenAI error object with the right 4xx; everyone else is still served."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.tiny_server import MODEL, app_for, with_client

GOOD = {"prompt": "good", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WINDOW = 512  # the tiny model's context window

# (path, body, status, param, code)
BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature", None),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt", None),
    ("/v1/completions", {"prompt": "x", "tag": "t" * 129}, 400, "tag", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "y" * WINDOW}, 400, "prompt", "context_length_exceeded"),
    (
        "/v1/completions",
        {"prompt": "y" * 500, "max_tokens": 20},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "bot", "content": "x"}]},
        400,
        "messages.0",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "z" * WINDOW}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
]


async def _post_all(client, requests):
    return await asyncio.gather(*(client.post(path, json=body) for path, body, *_ in requests))


@pytest.mark.parametrize("case", BAD, ids=lambda c: f"{c[3]}-{c[2]}")
def test_bad_request_gets_an_openai_error_naming_the_field(case):
    path, body, status, param, code = case
    response = with_client(app_for(), lambda c: c.post(path, json=body))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]


def test_malformed_json_and_non_objects_are_400():
    async def calls(client):
        return [
            await client.post("/v1/completions", content=b'{"prompt": "x",'),
            await client.post("/v1/chat/completions", content=b"[1, 2]"),
        ]

    malformed, not_object = with_client(app_for(), calls)
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
    assert not_object.status_code == 400


def test_bad_requests_among_good_ones_leave_the_good_ones_untouched():
    async def calls(client):
        alone = (await client.post("/v1/completions", json=GOOD)).json()
        mixed = [("/v1/completions", GOOD, 200, None, None)] * 4 + BAD
        return alone, await _post_all(client, mixed[::2] + mixed[1::2])

    alone, responses = with_client(app_for(), calls)
    good = [r for r in responses if r.request.content == responses[0].request.content]
    assert [r.status_code for r in good] == [200] * 4
    assert all(r.json()["choices"] == alone["choices"] for r in good)
    assert sorted(r.status_code for r in responses if r not in good) == sorted(c[2] for c in BAD)


def test_unknown_routes_and_methods_are_error_objects_too():
    async def calls(client):
        return await client.get("/v1/nothing"), await client.get("/v1/completions")

    missing, wrong_method = with_client(app_for(), calls)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_a_chat_request_to_a_model_without_a_template_is_400():
    from tests.engine.tiny import tiny_engine

    engine = tiny_engine(block_size=4, num_blocks=64)  # byte tokenizer, no chat template
    response = with_client(app_for(engine), lambda c: c.post("/v1/chat/completions", json=CHAT))
    assert response.status_code == 400 and "no chat template" in response.json()["error"]["message"]


def test_the_api_key_guards_v1_but_not_health_or_metrics():
    async def calls(client):
        ok = {"Authorization": "Bearer s3cret"}
        return [
            await client.post("/v1/completions", json=GOOD),
            await client.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer x"}),
            await client.get("/v1/models", headers={"Authorization": "s3cret"}),
            await client.post("/v1/completions", json=GOOD, headers=ok),
            await client.get("/v1/models", headers=ok),
            await client.get("/health"),
            await client.get("/metrics"),
        ]

    codes = [r.status_code for r in with_client(app_for(api_key="s3cret"), calls)]
    assert codes == [401, 401, 401, 200, 200, 200, 200]


def test_bodies_over_the_limit_are_413_whether_declared_or_streamed():
    big = b'{"prompt": "' + b"x" * 2000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 100):
            yield big[i : i + 100]

    async def calls(client):
        return [
            await client.post("/v1/completions", content=big),
            await client.post("/v1/completions", content=chunks()),  # no Content-Length
            await client.post("/v1/completions", json={**GOOD, "model": MODEL}),
        ]

    declared, streamed, fine = with_client(app_for(max_body_bytes=1000), calls)
    assert declared.status_code == streamed.status_code == 413
    assert (
        declared.json()["error"]["code"] == streamed.json()["error"]["code"] == "request_too_large"
    )
    assert fine.status_code == 200


@pytest.mark.parametrize("raw", ["1e400", "-1e400", "Infinity", "NaN"])
def test_temperatures_that_json_parses_as_infinite_or_nan_are_400(raw):
    body = b'{"prompt": "x", "max_tokens": 2, "temperature": ' + raw.encode() + b"}"
    response = with_client(app_for(), lambda c: c.post("/v1/completions", content=body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "temperature"


def test_max_tokens_past_what_the_kv_cache_holds_is_400_and_the_default_fits():
    from tests.server.tiny_server import tiny_chat_engine

    engine = tiny_chat_engine(num_blocks=64)  # 256 tokens of KV, under the 512-token window

    async def calls(client):
        prompt = list(range(1, 201))
        too_long = {"prompt": prompt, "max_tokens": 58, "ignore_eos": True}
        fits = {"prompt": prompt, "max_tokens": 57, "ignore_eos": True, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "x" * 200}], "ignore_eos": True}
        return [await client.post("/v1/completions", json=b) for b in (too_long, fits)] + [
            await client.post("/v1/chat/completions", json=chat)
        ]

    refused, fits, chat = with_client(app_for(engine), calls)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "KV cache holds 256" in refused.json()["error"]["message"]
    assert fits.json()["usage"]["completion_tokens"] == 57
    usage = chat.json()["usage"]  # no max_tokens: what the cache leaves, not the window
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 257
    assert chat.json()["choices"][0]["finish_reason"] == "length"
