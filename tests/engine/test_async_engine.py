"""The engine thread: aborts free blocks, excess load is refused, a failed step is survived."""

from __future__ import annotations

import asyncio

import pytest

from kvabi.engine.async_engine import AsyncEngine, OverloadedError
from kvabi.engine.request_handle import EngineError
from kvabi.engine.sampling_params import SamplingParams
from tests.server.tiny_server import app_for, tiny_chat_engine, with_client

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def _final(handle):
    return await handle.final()


def test_abort_of_a_running_request_frees_its_blocks():
    engine = tiny_chat_engine()

    async def main():
        loop = AsyncEngine(engine, max_in_flight=4)
        loop.start()
        handle = loop.submit([5, 6, 7, 8, 9], LONG)
        async for _ in handle.updates():
            break  # it has a token: it holds blocks
        await _until(lambda: loop.snapshot.num_running == 1)
        assert loop.snapshot.num_free_blocks < engine.cache.pool.num_blocks
        assert loop.abort(handle) and not loop.abort(handle)  # the second is a no-op
        await _until(lambda: loop.snapshot.num_running == 0)
        snapshot = loop.snapshot
        loop.stop()
        return snapshot

    snapshot = asyncio.run(main())
    assert snapshot.num_free_blocks == snapshot.num_blocks == 256
    assert not engine.requests and not engine.has_unfinished()


def test_submissions_past_max_in_flight_are_refused_until_one_ends():
    async def main():
        loop = AsyncEngine(tiny_chat_engine(), max_in_flight=1)
        loop.start()
        first = loop.submit([1, 2, 3], SHORT)
        with pytest.raises(OverloadedError):
            loop.submit([4, 5, 6], SHORT)
        await _final(first)
        second = await _final(loop.submit([4, 5, 6], SHORT))
        loop.stop()
        return second

    assert len(asyncio.run(main()).outputs[0].token_ids) == 5


def test_a_reader_that_comes_late_gets_the_steps_it_missed_joined():
    async def main():
        loop = AsyncEngine(tiny_chat_engine(), max_in_flight=4)
        loop.start()
        handle = loop.submit([1, 2, 3], SamplingParams(max_tokens=5, n=2, seed=1, ignore_eos=True))
        await _until(lambda: loop.num_in_flight == 0)  # finished before anyone read
        outs = [out async for out in handle.updates()]
        loop.stop()
        return outs

    (out,) = asyncio.run(main())
    assert out.finished and [len(c.token_ids) for c in out.outputs] == [5, 5]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on():
    engine = tiny_chat_engine()
    real_step, failures = engine.step, iter([RuntimeError("boom")])

    def flaky_step():
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real_step()

    engine.step = flaky_step

    async def main():
        loop = AsyncEngine(engine, max_in_flight=4)
        loop.start()
        with pytest.raises(EngineError, match="boom"):
            await _final(loop.submit([1, 2, 3], SHORT))
        after = await _final(loop.submit([1, 2, 3], SHORT))
        loop.stop()
        return after

    assert asyncio.run(main()).outputs[0].finish_reason == "length"
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_the_server_answers_503_with_retry_after_when_full():
    app = app_for(tiny_chat_engine(max_num_seqs=1), max_queued=0)
    body = {"prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def calls(client):
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await _until(lambda: app.state.serving.async_engine.num_in_flight == 1)
        refused = await client.post("/v1/completions", json=body)
        return await first, refused

    first, refused = with_client(app, calls)
    assert first.status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "server_overloaded"
