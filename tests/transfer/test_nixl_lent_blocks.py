"""NIXL READs straight from the prefill pool into the decode pool: a loan of the prefill
engine's pooled blocks, READ into blocks the decode engine reserved, verified, then indexed.
Real engines (the tiny model), in-process peers over loopback. Skipped without nixl."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.kv_cache import ImportResult
from kvabi.transfer import lent_blocks
from kvabi.transfer.errors import TransferError
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.transfer.transport import FetchRequest
from kvabi.wire.errors import ChecksumError
from tests.disagg.tiny_peers import engine, greedy, prefill_provider
from tests.engine.tiny import greedy_reference
from tests.transfer.test_nixl_transport import PROMPT, nixl, tcp_payload

pytestmark = pytest.mark.skipif(not is_nixl_available(), reason="nixl is not installed")


def released(e, timeout_s: float = 5.0) -> bool:
    """Whether the prefill's pool gets every block back (its server releases a loan once it
    reads our `done`, a moment after the fetch returned)."""
    deadline = time.monotonic() + timeout_s
    while e.cache.pool.num_free != 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    return e.cache.pool.num_free == 64


@pytest.fixture
def prefill():
    e = engine("nhd", 4)
    pool = e.cache.storage.buffers
    server = nixl().listen("127.0.0.1:0", e.info.descriptor, prefill_provider(e), pool)
    yield e, server
    server.close()


def test_lent_blocks_land_in_the_reserved_ones_and_decode_like_the_prefill(prefill):
    e, server = prefill
    decode = engine("nhd", 4)  # the peer's descriptor: blocks are READ as they lie
    client = nixl().connect(server.address, decode.info.descriptor)
    assert client.can_read_blocks(decode.info.descriptor)
    assert client.can_read_blocks(engine("hnd", 8).info.descriptor)  # through staging
    other_shard = decode.info.descriptor.with_layout(tp_size=2, tp_rank=1)
    assert not client.can_read_blocks(other_shard)
    taken = decode.cache.pool.allocate(3)  # so the reserved blocks are not the lent ones' ids
    reservation = decode.cache.reserve(PROMPT, None, 0, 5)
    assert reservation.block_ids == (3, 4, 5, 6, 7) and reservation.pooled == ()

    landed = client.fetch_into(FetchRequest(PROMPT), reservation)

    assert (landed.num_blocks, landed.payload) == (5, None)
    assert released(e)  # the loan: nothing stays pinned on the peer
    sent = tcp_payload(FetchRequest(PROMPT), decode.info.descriptor)  # NHD blocks of 4
    for key, t in decode.cache.storage.buffers.tensors.items():
        assert torch.equal(t[:, 3:8], sent.cache.tensors[key]), key
    assert decode.cache.commit(reservation, landed.num_blocks) == ImportResult(20, 5)
    decode.cache.pool.free(taken)
    want = greedy(engine("nhd", 4), list(PROMPT))
    assert greedy(decode, list(PROMPT)) == want == list(greedy_reference(PROMPT, len(want)))
    client.close()


def test_a_suffix_is_lent_after_the_held_prefix(prefill):
    e, server = prefill
    decode = engine("nhd", 4)
    client = nixl().connect(server.address, decode.info.descriptor)
    first = decode.cache.reserve(PROMPT, None, 0, 2)
    assert client.fetch_into(FetchRequest(PROMPT), first).num_blocks == 2  # asks for 8 tokens
    assert decode.cache.commit(first, 2) == ImportResult(8, 2)
    rest = decode.cache.reserve(PROMPT, None, 8, 3)
    assert rest.pooled == (0, 1)  # the held prefix stays pinned meanwhile
    assert client.fetch_into(FetchRequest(PROMPT, 8), rest).num_blocks == 3
    assert decode.cache.commit(rest, 3) == ImportResult(20, 3)
    assert decode.cache.pool.num_free == 64 and released(e)
    client.close()


def test_a_byte_damaged_on_the_way_fails_its_checksum_and_is_not_indexed(prefill, monkeypatch):
    e, server = prefill
    decode = engine("nhd", 4)
    real_read = lent_blocks.nixl_read_extents

    def read_then_damage(agent, peer, extents, timeout_s):  # one bit flips in transit
        real_read(agent, peer, extents, timeout_s)
        decode.cache.storage.buffers.tensors["1"][1, 3].view(torch.uint8).view(-1)[9] ^= 4

    monkeypatch.setattr(lent_blocks, "nixl_read_extents", read_then_damage)
    client = nixl().connect(server.address, decode.info.descriptor)
    reservation = decode.cache.reserve(PROMPT, None, 0, 5)
    assert reservation.block_ids == (0, 1, 2, 3, 4)
    with pytest.raises(ChecksumError, match=r"buffers \['1'\]"):
        client.fetch_into(FetchRequest(PROMPT), reservation)
    decode.cache.cancel(reservation)
    assert (decode.cache.pool.num_free, decode.cache.pool.num_cached) == (64, 0)
    assert released(e)
    client.close()


@pytest.mark.parametrize(("layout", "block_size"), [("hnd", 8), ("hnd", 4), ("nhd", 2)])
def test_another_layout_is_read_into_staging_and_converted_part_by_part(
    prefill, layout, block_size
):
    e, server = prefill  # NHD blocks of 4; PROMPT has 20 whole tokens
    decode = engine(layout, block_size)
    client = nixl().connect(server.address, decode.info.descriptor)
    assert client.can_read_blocks(decode.info.descriptor)
    num_tokens = 20 // math.lcm(4, block_size) * math.lcm(4, block_size)  # whole in both sizes
    reservation = decode.cache.reserve(PROMPT, None, 0, 20 // block_size)
    landed = client.fetch_into(FetchRequest(PROMPT), reservation)
    assert (landed.num_blocks, landed.payload) == (num_tokens // block_size, None)
    result = decode.cache.commit(reservation, landed.num_blocks)
    assert result == ImportResult(num_tokens, num_tokens // block_size)
    assert released(e)
    # the same blocks as the container path's conversion gives
    sent = tcp_payload(FetchRequest(PROMPT), decode.info.descriptor)
    staged = stage_payload(sent, decode.info.descriptor)
    mine = decode.cache.export(PROMPT, None, 0)
    assert mine.cache.extent == staged.cache.extent == num_tokens // block_size
    for key, t in mine.cache.tensors.items():
        assert torch.equal(t, staged.cache.tensors[key]), key
    want = greedy(engine("nhd", 4), list(PROMPT))
    assert greedy(decode, list(PROMPT)) == want == list(greedy_reference(PROMPT, len(want)))
    client.close()


def test_a_provider_that_cannot_lend_answers_with_a_container():
    e = engine("nhd", 4)
    provide = prefill_provider(e)
    server = nixl().listen(
        "127.0.0.1:0", e.info.descriptor, lambda r: provide(FetchRequest(r.token_ids))
    )  # never lends: as a hybrid or TP prefill
    decode = engine("nhd", 4)
    client = nixl().connect(server.address, decode.info.descriptor)
    reservation = decode.cache.reserve(PROMPT, None, 0, 5)
    landed = client.fetch_into(FetchRequest(PROMPT), reservation)
    decode.cache.cancel(reservation)
    assert landed.num_blocks == 0 and landed.payload.end_token == 20
    client.close(), server.close()


def test_a_loan_to_a_transport_that_cannot_read_blocks_goes_as_a_copy():
    from kvabi.transfer.tcp_transport import TcpTransport
    from tests.disagg.tiny_peers import config

    e = engine("nhd", 4)
    provide = prefill_provider(e)
    server = TcpTransport(config()).listen(
        "127.0.0.1:0",
        e.info.descriptor,
        lambda r: provide(FetchRequest(r.token_ids, 0, None, True)),
    )  # lends whatever is asked
    client = TcpTransport(config()).connect(server.address, e.info.descriptor)
    payload = client.fetch(FetchRequest(PROMPT))
    assert payload.end_token == 20 and e.cache.pool.num_free == 64  # copied, then released
    with pytest.raises(NotImplementedError, match="cannot read a peer's pool blocks"):
        client.fetch_into(FetchRequest(PROMPT), None)
    client.close(), server.close()


def test_a_loan_of_a_pool_listen_was_not_given_is_refused_not_read():
    e = engine("nhd", 4)
    provide = prefill_provider(e)
    other = CacheBuffers.empty(e.info.descriptor, 8)  # not registered: peers cannot READ it
    lend_other = lambda r: replace(provide(r), buffers=other)  # noqa: E731
    server = nixl().listen("127.0.0.1:0", e.info.descriptor, lend_other, e.cache.storage.buffers)
    decode = engine("nhd", 4)
    client = nixl().connect(server.address, decode.info.descriptor)
    reservation = decode.cache.reserve(PROMPT, None, 0, 5)
    with pytest.raises(TransferError):
        client.fetch_into(FetchRequest(PROMPT), reservation)
    decode.cache.cancel(reservation)
    assert released(e)  # the loan went back all the same
    client.close(), server.close()
