"""The prefill role over the real TCP transport, in process: a prompt's KV goes out layer by
layer while the forward computes the later layers, and is the same KV as a whole export."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvabi.cache.kv_cache import KVCache
from kvabi.disagg.roles import PrefillRole, PromptFeeds
from kvabi.disagg.settings import DisaggSettings
from kvabi.engine.async_engine import AsyncEngine
from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvabi.transfer import tcp_transport
from kvabi.transfer.errors import RemoteError
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest
from kvabi.wire.container import LayerSection
from tests.disagg.tiny_peers import SECRET, config, greedy
from tests.engine.tiny import tiny_loaded

NUM_LAYERS = 4
PROMPT = tuple(range(3, 24))  # 21 tokens: 5 blocks of 4 + 1


def engine(layout: str = "nhd", block_size: int = 4, feeds: PromptFeeds | None = None) -> LLMEngine:
    """An engine; with `feeds`, a prefill instance that streams prompts layer by layer."""
    cfg = EngineConfig(kv_layout=layout, block_size=block_size, num_blocks=64)
    hooks = EngineHooks(on_prompt_layer=feeds)
    return LLMEngine(tiny_loaded(layers=NUM_LAYERS), cfg, fingerprint="tiny", hooks=hooks)


def prefill_engine() -> LLMEngine:
    return engine(feeds=PromptFeeds())


class Recorder:
    """The order of layers stored by the prefill's forward and sections read by the client;
    the last layer is held back until the client has read section 0 (at most 5 s)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int]] = []
        self.first_received = threading.Event()
        self.waited: bool | None = None
        real = tcp_transport.iter_layers

        def iter_layers(*args: object):  # noqa: ANN202
            for item in real(*args):  # type: ignore[arg-type]
                if isinstance(item, LayerSection):
                    self.events.append(("received", item.layer_id))
                    self.first_received.set()
                yield item

        monkeypatch.setattr(tcp_transport, "iter_layers", iter_layers)

    def feeds(self) -> PromptFeeds:
        """The prefill's hook, recording each layer stored (and holding back the last)."""
        rec = self

        class RecordingFeeds(PromptFeeds):
            def __call__(self, cache: KVCache, layer_id: int, seqs: tuple) -> None:
                if layer_id == NUM_LAYERS - 1:
                    rec.waited = rec.first_received.wait(5)
                rec.events.append(("stored", layer_id))
                super().__call__(cache, layer_id, seqs)

        return RecordingFeeds()


async def serve_and_fetch(prefill: LLMEngine, decode: LLMEngine, request: FetchRequest):
    async_engine = AsyncEngine(prefill, max_in_flight=4)
    async_engine.start()
    settings = DisaggSettings("prefill", SECRET, kv_address="127.0.0.1:0", transfer_timeout_s=10)
    role = PrefillRole(settings, async_engine)
    role.start()
    client = TcpTransport(config()).connect(role.server.address, decode.info.descriptor)
    try:
        payload = await asyncio.to_thread(client.fetch, request)
        ids, start = request.token_ids, request.start_token
        whole = await async_engine.call(lambda e: e.cache.export(ids, None, start))
        return payload, whole
    finally:
        client.close(), role.stop()
        await asyncio.to_thread(async_engine.stop)


def test_layer_l_is_on_the_wire_before_the_last_layer_is_computed(monkeypatch):
    rec = Recorder(monkeypatch)
    prefill, decode = engine(feeds=rec.feeds()), engine("hnd", 8)
    payload, whole = asyncio.run(serve_and_fetch(prefill, decode, FetchRequest(PROMPT)))
    assert rec.waited is True  # section 0 was read while the last layer was not yet stored
    assert rec.events.index(("received", 0)) < rec.events.index(("stored", NUM_LAYERS - 1))
    assert [e for e in rec.events if e[0] == "stored"] == [("stored", i) for i in range(4)]
    assert [e for e in rec.events if e[0] == "received"] == [("received", i) for i in range(4)]
    # the streamed blocks are exactly the pooled blocks a whole export sends afterwards
    assert (payload.start_token, payload.token_ids) == (0, PROMPT[:20])
    assert payload.block_hashes == whole.block_hashes and payload.cache.extent == 5
    assert payload.cache.tensors.keys() == whole.cache.tensors.keys()
    for key, t in whole.cache.tensors.items():
        assert torch.equal(payload.cache.tensors[key], t), key


def test_streamed_kv_decodes_identically_to_colocated():
    prefill, decode = prefill_engine(), engine("hnd", 8)
    payload, _ = asyncio.run(serve_and_fetch(prefill, decode, FetchRequest(PROMPT)))
    staged = stage_payload(payload, decode.info.descriptor)
    assert decode.cache.import_blocks(PROMPT, None, staged).num_cached_tokens == 16
    assert greedy(decode, list(PROMPT)) == greedy(engine(), list(PROMPT))
    assert decode.cache_stats()["prefix_hit_tokens"] == 16


def test_a_fetch_from_a_held_prefix_streams_only_the_rest():
    prefill, decode = prefill_engine(), engine()
    payload, whole = asyncio.run(serve_and_fetch(prefill, decode, FetchRequest(PROMPT, 8)))
    assert (payload.start_token, payload.token_ids, payload.cache.extent) == (8, PROMPT[8:20], 3)
    assert payload.block_hashes == whole.block_hashes
    for key, t in whole.cache.tensors.items():
        assert torch.equal(payload.cache.tensors[key], t), key


def test_nothing_to_send_runs_no_prefill_and_a_bad_prompt_gets_an_error():
    prefill, decode = prefill_engine(), engine()
    payload, _ = asyncio.run(serve_and_fetch(prefill, decode, FetchRequest(PROMPT[:3])))
    assert (payload.token_ids, payload.cache.extent) == ((), 0)
    assert prefill.cache.pool.num_cached == 0  # no prefill ran
    with pytest.raises(RemoteError, match="token ids must be in"):
        asyncio.run(serve_and_fetch(prefill, decode, FetchRequest((3, 4, 999, 5, 6))))


def test_a_loan_made_after_its_fetch_gave_up_goes_back_to_the_pool():
    prefill = engine()

    async def main() -> tuple[int, int]:
        async_engine = AsyncEngine(prefill, max_in_flight=4)
        async_engine.start()
        settings = DisaggSettings(
            "prefill", SECRET, kv_address="127.0.0.1:0", transfer_timeout_s=0.001
        )
        role = PrefillRole(settings, async_engine)
        role.start()
        try:
            lend = FetchRequest(PROMPT, 0, None, reads_blocks=True)
            with pytest.raises(TimeoutError):  # the prefill takes longer than 1 ms
                await asyncio.to_thread(role._provide, lend)
            for _ in range(100):  # the prefill ends, lends, and the loan is released
                await asyncio.sleep(0.02)
                cached, free = await async_engine.call(
                    lambda e: (e.cache.pool.num_cached, e.cache.pool.num_free)
                )
                if cached and free == 64:
                    break
            return cached, free
        finally:
            role.stop()
            await asyncio.to_thread(async_engine.stop)

    cached, free = asyncio.run(main())
    assert cached >= 5 and free == 64  # the prompt's blocks were cached, none stays pinned
