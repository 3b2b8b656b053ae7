"""One bad request never hurts another; an engine that stops making progress says so."""

from __future__ import annotations

import asyncio

import pytest

import kvabi.engine.engine as engine_module
from tests.server.test_metrics import scrape
from tests.server.tiny_server import app_for, sse_events, tiny_chat_engine, with_client

GOOD = {"prompt": "good", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
POISON_SEED = 7


@pytest.fixture
def poisoned_sampler(monkeypatch):
    real = engine_module.sample

    def sample(logits, params, generator):
        if params.seed == POISON_SEED:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)


def test_a_request_that_fails_sampling_fails_alone(poisoned_sampler):
    bad = {"prompt": "bad", "max_tokens": 8, "temperature": 0.7, "seed": POISON_SEED}

    async def calls(client):
        alone = await client.post("/v1/completions", json=GOOD)
        together = await asyncio.gather(
            client.post("/v1/completions", json=GOOD | {"stream": True}),
            client.post("/v1/completions", json=bad),
            client.post("/v1/completions", json=bad | {"stream": True}),
            client.post("/v1/completions", json=GOOD),
        )
        return alone, together

    app = app_for()
    alone, (streamed, bad_plain, bad_streamed, plain) = with_client(app, calls)
    text = alone.json()["choices"][0]["text"]
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == text
    events = sse_events(streamed.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == text
    assert bad_plain.status_code == 500
    assert "probability tensor" in bad_plain.json()["error"]["message"]
    bad_events = sse_events(bad_streamed.text)
    assert "probability tensor" in bad_events[-2]["error"]["message"] and bad_events[-1] == "[DONE]"
    engine = app.state.serving.engine
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks and not engine.requests


def test_health_reports_an_engine_that_has_work_but_makes_no_progress():
    engine = tiny_chat_engine()
    real_step, stuck = engine.step, {"on": False}
    engine.step = lambda: [] if stuck["on"] else real_step()  # a step that schedules nothing
    app = app_for(engine, stall_timeout_s=0.3)

    async def calls(client):
        ok = await client.get("/health")
        stuck["on"] = True
        request = asyncio.create_task(client.post("/v1/completions", json=GOOD))
        await asyncio.sleep(0.6)
        stalled = await client.get("/health")
        stuck["on"] = False
        served = await request
        return ok, stalled, served, await client.get("/health")

    ok, stalled, served, again = with_client(app, calls)
    assert ok.status_code == 200 and again.status_code == 200
    assert stalled.status_code == 503 and stalled.json()["status"] == "engine stalled"
    assert stalled.json()["waiting"] == 1 and stalled.json()["seconds_without_progress"] >= 0.3
    assert served.status_code == 200


def test_an_idle_engine_is_healthy_however_long_it_idles():
    async def calls(client):
        await client.post("/v1/completions", json=GOOD)
        await asyncio.sleep(0.5)
        return await client.get("/health")

    assert with_client(app_for(stall_timeout_s=0.2), calls).status_code == 200


def test_tags_that_sanitise_alike_are_distinct_label_values():
    tags = ["a b{c}", "a_b_c", "a.b.c", "A B C"]

    async def calls(client):
        for i, tag in enumerate(tags):
            for _ in range(i + 1):
                body = GOOD | {"tag": tag, "max_tokens": 1}
                assert (await client.post("/v1/completions", json=body)).status_code == 200
        return (await client.get("/metrics")).text

    m = scrape(with_client(app_for(), calls))
    got = {tag: m["kvabi_cache_tag_queries", (("tag", tag),)] for tag in tags}
    assert got == {"a b{c}": 1, "a_b_c": 2, "a.b.c": 3, "A B C": 4}
