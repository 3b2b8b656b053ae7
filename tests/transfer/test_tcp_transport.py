"""The TCP transport between in-process engines over real loopback sockets: handshake,
negotiation, transfer, conversion on arrival, and every refusal."""

from __future__ import annotations

import socket
import time

import pytest

from kvabi.cache.kv_cache import ImportResult
from kvabi.transfer.errors import (
    AuthError,
    MessageTooLargeError,
    PeerIncompatibleError,
    TransferTimeoutError,
)
from kvabi.transfer.framing import LENGTH, recv_msg
from kvabi.transfer.kv_staging import fetch_start, stage_payload
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest, TransportConfig
from kvabi.wire.errors import ChecksumError
from tests.disagg.tiny_peers import (
    SECRET,
    config,
    engine,
    greedy,
    prefill_provider,
    prefill_server,
)
from tests.engine.tiny import greedy_reference
from tests.transfer.faults import faulty

PROMPT = tuple(range(3, 24))  # 21 tokens: 5 blocks of 4 + 1, 2 blocks of 8 + 5


@pytest.fixture
def prefill():
    e = engine("nhd", 4)
    server = prefill_server(e)
    yield e, server
    server.close()


def connect(server, decode, cfg: TransportConfig | None = None):
    return TcpTransport(cfg or config()).connect(server.address, decode.info.descriptor)


def test_mixed_layouts_transfer_and_decode_identically(prefill):
    _, server = prefill
    decode = engine("hnd", 8)  # HND blocks of 8 receiving NHD blocks of 4
    client = connect(server, decode)
    assert client.peer_desc.layout.block_size == 4
    payload = client.fetch(FetchRequest(PROMPT))
    assert (payload.start_token, payload.end_token, payload.cache.extent) == (0, 20, 5)
    assert payload.token_ids == PROMPT[:20]
    staged = stage_payload(payload, decode.info.descriptor)  # re-blocked, off the engine thread
    assert (staged.end_token, staged.cache.extent, staged.cache.desc) == (
        16,
        2,
        decode.info.descriptor,
    )
    assert decode.cache.import_blocks(PROMPT, None, staged) == ImportResult(16, 2)
    assert decode.cache.pool.num_free == 64 and decode.cache.pool.num_cached == 2  # cached
    # the decode side computes only the prompt's tail: exact, as the margins are clear (tiny.py)
    want = greedy(engine("nhd", 4), list(PROMPT))
    assert greedy(decode, list(PROMPT)) == want == list(greedy_reference(PROMPT, len(want)))
    assert decode.cache_stats()["prefix_hit_tokens"] == 16
    client.close()


def test_fetch_skips_blocks_the_decode_side_holds(prefill):
    _, server = prefill
    decode = engine("nhd", 8)
    greedy(decode, list(PROMPT[:17]), 1)  # pools the first 2 blocks of 8
    held = decode.cache.num_pooled(decode.cache.hasher.hashes(PROMPT)) * decode.cache.block_size
    assert held == 16 and fetch_start(held, 8, 4) == 16 and fetch_start(12, 8, 12) == 0
    payload = connect(server, decode).fetch(FetchRequest(PROMPT, 16))
    assert (payload.start_token, payload.token_ids) == (16, PROMPT[16:20])
    assert decode.cache.import_blocks(PROMPT, None, payload) == ImportResult(16, 0)  # no 8-block
    fresh = engine("nhd", 4)  # lost what it held meanwhile: a gap, nothing placed
    assert fresh.cache.import_blocks(PROMPT, None, payload) == ImportResult(0, 0)
    pooled = engine("nhd", 4)
    greedy(pooled, list(PROMPT[:17]), 1)  # holds 4 blocks of 4: the payload's one extends them
    assert pooled.cache.import_blocks(PROMPT, None, payload) == ImportResult(20, 1)


def test_a_wrong_secret_is_refused_on_both_sides(prefill):
    _, server = prefill
    with pytest.raises(AuthError):
        connect(server, engine(), TransportConfig(b"another-secret-of-16+"))
    assert connect(server, engine()).fetch(FetchRequest(PROMPT)).end_token == 20  # still serving


def test_another_model_is_refused_at_connect_time(prefill):
    _, server = prefill
    with pytest.raises(PeerIncompatibleError, match="fingerprint 'other' != 'tiny'"):
        TcpTransport(config()).connect(server.address, engine(fingerprint="other").info.descriptor)


def test_a_corrupt_payload_fails_its_checksum_and_places_nothing():
    server = prefill_server(engine(), transport=faulty(TcpTransport, "corrupt"))
    decode = engine("hnd", 8)
    with pytest.raises(ChecksumError, match="layer 0 is corrupt"):
        connect(server, decode).fetch(FetchRequest(PROMPT))
    assert (decode.cache.pool.num_free, decode.cache.pool.num_cached) == (64, 0)
    server.close()


def test_a_stalled_transfer_times_out():
    server = prefill_server(engine(), transport=faulty(TcpTransport, "stall:3"))
    client = connect(server, engine(), config(io_timeout_s=0.5))
    with pytest.raises(TransferTimeoutError):
        client.fetch(FetchRequest(PROMPT))
    server.close()


def test_an_oversized_message_is_refused_before_allocating(prefill):
    _, server = prefill
    host, port = server.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        assert recv_msg(raw)["t"] == "challenge"
        raw.sendall(LENGTH.pack(2**32 - 1))  # a 4 GiB "auth" message: the server hangs up
        assert raw.recv(1) == b""
    a, b = socket.socketpair()
    a.sendall(LENGTH.pack(9 * 2**20))
    with pytest.raises(MessageTooLargeError, match="cap is"):
        recv_msg(b)
    a.close(), b.close()


def test_the_secret_must_be_long_enough():
    with pytest.raises(ValueError, match="16 bytes"):
        TransportConfig(b"short")
    assert len(SECRET) >= 16


def test_an_idle_connection_the_peer_dropped_is_replaced():
    server = prefill_server(engine(), config(idle_timeout_s=0.2))
    client = connect(server, engine())
    time.sleep(0.5)  # the server closes the handshaken connection it saw no request on
    assert client.fetch(FetchRequest(PROMPT)).end_token == 20
    server.close()


def test_a_prompt_shorter_than_a_block_sends_an_empty_container(prefill):
    _, server = prefill
    decode = engine("hnd", 8)
    payload = connect(server, decode).fetch(FetchRequest(PROMPT[:3]))
    assert (payload.start_token, payload.token_ids, payload.cache.extent) == (0, (), 0)
    assert decode.cache.import_blocks(PROMPT[:3], None, payload).num_placed_blocks == 0


def test_a_peer_that_is_busy_past_the_stall_timeout_is_waited_for():
    # The prefill side says `wait` every io_timeout/3 until its first layer is ready, so only
    # a silent (frozen) peer trips the stall timeout; a busy one has the whole transfer timeout.
    e = engine()
    provide = prefill_provider(e)

    def slow(request):
        time.sleep(1.5)
        return provide(request)

    server = TcpTransport(config()).listen("127.0.0.1:0", e.info.descriptor, slow)
    client = connect(server, engine(), config(io_timeout_s=0.5))
    assert client.fetch(FetchRequest(PROMPT)).end_token == 20
    server.close()
