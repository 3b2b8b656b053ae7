"""A frozen (SIGSTOPped) prefill peer costs a request its stall timeout once, not the transfer
timeout every time: the decode side backs off from it, the router stops naming it, and both
take it back once it answers again. Real processes on the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from kvabi.routing.router import RouterConfig, create_router_app
from tests.disagg.processes import Instance, start_all, tiny_args
from tests.server.tiny_server import tiny_folder

CHAT = {"model": "tiny", "max_tokens": 4, "temperature": 0}


def chat(words: str) -> dict:
    return CHAT | {"messages": [{"role": "user", "content": words}]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = str(tiny_folder(tmp_path_factory.mktemp("tiny")))
    prefill = Instance(tiny_args(folder), "prefill", "nhd", 4)
    decode = Instance(
        tiny_args(folder),
        "decode",
        "nhd",
        4,
        *("--kv-peer", prefill.kv_address, "--kv-timeout", "1", "--kv-peer-cooldown", "3"),
    )
    start_all([prefill, decode])
    yield prefill, decode
    os.kill(prefill.process.process.pid, signal.SIGCONT)
    for i in (prefill, decode):
        i.process.stop()


def timed_post(decode: Instance, body: dict, peer: str) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    url, headers = f"{decode.url}/v1/chat/completions", {"x-kvabi-prefill": peer}
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - start, r


def test_a_frozen_prefill_peer_is_given_up_on_in_the_stall_timeout_then_backed_off(pair):
    prefill, decode = pair
    _, warm = timed_post(decode, chat("one two three four five six"), prefill.kv_address)
    assert warm.headers["x-kvabi-kv"].startswith("prefill;tokens=")
    os.kill(prefill.process.process.pid, signal.SIGSTOP)
    try:
        for i in range(3):  # before: each waited the 120 s transfer timeout
            took, r = timed_post(decode, chat(f"frozen peer number {i} here"), prefill.kv_address)
            assert r.headers["x-kvabi-kv"] == "local;reason=TransferTimeoutError"
            assert took < 5.0
        took, r = timed_post(decode, chat("skipped while it cools down"), prefill.kv_address)
        assert r.headers["x-kvabi-kv"] == "local;reason=peer-backed-off" and took < 1.0
    finally:
        os.kill(prefill.process.process.pid, signal.SIGCONT)
    time.sleep(3.2)  # the cooldown: the next fetch is a probe, and the peer answers it
    _, r = timed_post(decode, chat("the peer is back again now"), prefill.kv_address)
    assert r.headers["x-kvabi-kv"].startswith("prefill;tokens=")


def test_the_router_stops_naming_a_prefill_peer_that_fails_its_health_checks(pair):
    prefill, decode = pair
    app = create_router_app(
        RouterConfig((prefill.target,), (decode.url,), health_interval_s=0.3, health_timeout_s=0.5)
    )
    router = app.state.router

    async def main() -> list[str]:
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
            await asyncio.sleep(0.5)
            named = [router.candidates()[0][1]["x-kvabi-prefill"]]
            os.kill(prefill.process.process.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(1.2)
                named.append(router.candidates()[0][1]["x-kvabi-prefill"])
                r = await client.post("/v1/chat/completions", json=chat("routed while frozen"))
                named.append(r.headers["x-kvabi-kv"])
            finally:
                os.kill(prefill.process.process.pid, signal.SIGCONT)
            await asyncio.sleep(1.2)
            named.append(router.candidates()[0][1]["x-kvabi-prefill"])
            await client.aclose()
        return named

    named = asyncio.run(main())
    assert named == [prefill.kv_address, "none", "local;reason=no-peer", prefill.kv_address]
