"""`kvabi serve --kv-events`: the server publishes its pool's block events, and answers the
router's tokenize route with the ids and hash root the pool hashes with."""

import time

import msgpack
import pytest
import zmq

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.server.app import server_hooks
from kvabi.server.launch import free_port
from kvabi.server.settings import ServerSettings
from tests.server.tiny_server import app_for, tiny_chat_engine, with_client

IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks of 4, and one token more


@pytest.mark.parametrize("form", ["map", "array"])
def test_a_request_publishes_its_full_blocks_with_their_exact_hashes(form):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = tiny_chat_engine(server_hooks(ServerSettings("tiny", kv_events=endpoint)))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10_000)

    async def run(client):
        sub.connect(endpoint)
        time.sleep(0.5)  # the subscription reaches the publisher
        body = {"model": "tiny", "prompt": IDS, "max_tokens": 1, "temperature": 0}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        return sub.recv_multipart()

    try:
        app = app_for(engine, kv_events=endpoint, kv_events_format=form)
        topic, seq, payload = with_client(app, run)
    finally:
        sub.close(linger=0)
        ctx.term()
    root = root_hash(engine.info.descriptor.model.compat_digest())
    assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
    stored = {
        "type": "BlockStored",
        "block_hashes": hash_blocks(IDS[:8], 4, root),
        "parent_block_hash": None,
        "token_ids": IDS[:8],
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    want = stored if form == "map" else list(stored.values())  # array: the tag, fields in order
    assert msgpack.unpackb(payload)[1] == [want]
    assert engine.cache.pool.events is engine.hooks.block_events is not None


def test_tokenize_answers_the_chat_prompt_ids_and_the_salted_hash_root():
    engine = tiny_chat_engine()
    messages = [{"role": "user", "content": "hi"}]

    async def run(client):
        chat = {"model": "tiny", "messages": messages, "cache_salt": "tenant-a"}
        ok = await client.post("/kvabi/tokenize/v1/chat/completions", json=chat)
        plain = await client.post("/kvabi/tokenize/v1/completions", json={"prompt": IDS})
        wrong = await client.post(
            "/kvabi/tokenize/v1/completions", json={"model": "x", "prompt": IDS}
        )
        return ok, plain, wrong

    ok, plain, wrong = with_client(app_for(engine), run)
    digest = engine.info.descriptor.model.compat_digest()
    want_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ok.json() == {
        "token_ids": list(want_ids),
        "hash_root": root_hash(digest, {"cache_salt": "tenant-a"}).hex(),
        "block_size": 4,
    }
    assert plain.json() == {"token_ids": IDS, "hash_root": root_hash(digest).hex(), "block_size": 4}
    assert wrong.status_code == 404
    assert engine.cache.pool.events is None  # no --kv-events: no sink, nothing published


def test_publishing_needs_an_engine_built_with_the_event_log():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="server_hooks"):
        with_client(app_for(tiny_chat_engine(), kv_events=endpoint), lambda client: None)
