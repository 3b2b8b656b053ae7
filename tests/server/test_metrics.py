"""/metrics agrees with what the clients were told, and exports the engine's cache_stats()."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.tiny_server import app_for, tiny_chat_engine, with_client

MAX_TOKENS = [3, 5, 8, 13]


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _requests(client):
    bodies = [
        {"prompt": "m" * (i + 1), "max_tokens": m, "temperature": 0, "ignore_eos": True}
        for i, m in enumerate(MAX_TOKENS)
    ]
    return asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_counters_and_histograms_match_the_usage_clients_saw():
    engine = tiny_chat_engine()

    async def calls(client):
        responses = await _requests(client)
        await client.post("/v1/completions", json={"prompt": ""})  # one 400
        return responses, (await client.get("/metrics")).text

    responses, text = with_client(app_for(engine), calls)
    usages = [r.json()["usage"] for r in responses]
    m = scrape(text)
    n = len(MAX_TOKENS)
    assert [u["completion_tokens"] for u in usages] == MAX_TOKENS
    assert m["kvabi_requests_total", (("outcome", "finished"),)] == n
    assert m["kvabi_choices_finished_total", (("finish_reason", "length"),)] == n
    assert m["kvabi_generation_tokens_total", ()] == sum(u["completion_tokens"] for u in usages)
    assert m["kvabi_prompt_tokens_total", ()] == sum(u["prompt_tokens"] for u in usages)
    assert m["kvabi_time_to_first_token_seconds_count", ()] == n
    assert m["kvabi_e2e_request_latency_seconds_count", ()] == n
    # one token per step for each request: every token after the first is one inter-token gap
    assert m["kvabi_inter_token_latency_seconds_count", ()] == sum(MAX_TOKENS) - n
    ok = (("route", "/v1/completions"), ("status", "200"))
    bad = (("route", "/v1/completions"), ("status", "400"))
    assert (m["kvabi_http_requests_total", ok], m["kvabi_http_requests_total", bad]) == (n, 1)
    assert m["kvabi_kv_blocks_total", ()] == m["kvabi_kv_blocks_free", ()] == 256
    assert m["kvabi_kv_blocks_used", ()] == 0
    assert m["kvabi_requests_running", ()] == m["kvabi_requests_waiting", ()] == 0
    if hasattr(engine, "cache_stats"):  # the engine is idle now: its figures are the exported ones
        exported = {k: v for (k, _), v in m.items() if k.startswith("kvabi_cache_")}
        assert exported == {f"kvabi_cache_{k}": v for k, v in engine.cache_stats().items()}


def test_an_engine_without_cache_stats_exports_no_cache_gauges():
    engine = tiny_chat_engine()
    engine.cache_stats = None  # as before the prefix cache: not a method

    async def calls(client):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return (await client.get("/metrics")).text

    m = scrape(with_client(app_for(engine), calls))
    assert m["kvabi_requests_total", (("outcome", "finished"),)] == 1
    assert not any(name.startswith("kvabi_cache_") for name, _ in m)


def test_the_engines_cache_stats_become_kvabi_cache_gauges():
    engine = tiny_chat_engine()
    engine.cache_stats = lambda: {
        "prefix_query_tokens": 40.0,
        "prefix_hit_tokens": 16.0,
        "hit rate": 0.4,
    }

    async def calls(client):
        return (await client.get("/metrics")).text

    m = scrape(with_client(app_for(engine), calls))
    assert m["kvabi_cache_prefix_query_tokens", ()] == 40.0
    assert m["kvabi_cache_prefix_hit_tokens", ()] == 16.0
    assert m["kvabi_cache_hit_rate", ()] == 0.4


def test_cache_salt_and_tag_reach_the_prefix_cache():
    engine = tiny_chat_engine()
    if not callable(getattr(engine, "cache_stats", None)):
        pytest.skip("this engine has no prefix cache yet")
    prompt = list(range(10, 30))  # 20 tokens: 5 full blocks of 4

    async def calls(client):
        hits = []
        for salt in ("alice", "bob", "alice"):
            body = {"prompt": prompt, "max_tokens": 2, "cache_salt": salt, "tag": "faq"}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            hits.append(scrape((await client.get("/metrics")).text))
        return hits

    first, other_tenant, same_tenant = with_client(app_for(engine), calls)
    hit = ("kvabi_cache_prefix_hit_tokens", ())
    assert first[hit] == other_tenant[hit] == 0  # another salt never shares blocks
    assert same_tenant[hit] > 0
    assert same_tenant["kvabi_cache_tag_queries", (("tag", "faq"),)] == 3


def test_speculative_decodings_counters_reach_metrics():
    engine = tiny_chat_engine(speculative="ngram:k=4")
    body = {"prompt": [7, 3] * 9, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def calls(client):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        await asyncio.sleep(0.1)  # the engine thread's snapshot after its last step
        return (await client.get("/metrics")).text

    m = scrape(with_client(app_for(engine), calls))
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0
    assert m["kvabi_spec_decode_num_draft_tokens", ()] == stats.num_draft_tokens
    assert m["kvabi_spec_decode_num_accepted_tokens", ()] == stats.num_accepted_tokens
    assert m["kvabi_spec_decode_num_drafts", ()] == stats.num_steps
    plain = scrape(with_client(app_for(tiny_chat_engine()), lambda c: c.get("/metrics")).text)
    assert not any(name.startswith("kvabi_spec_decode") for name, _ in plain)
