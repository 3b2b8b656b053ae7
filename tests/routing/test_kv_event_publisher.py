"""Block events over ZMQ: a plain msgpack + zmq subscriber written from vLLM's schema (not our
decoder) reads them, the replay socket answers as vLLM's does, and our subscriber feeds the
router's index."""

import time

import msgpack
import pytest
import zmq

from kvabi.cache.block_events import UNIFORM, BlockEventLog
from kvabi.routing.kv_event_publisher import END_SEQ, KVEventPublisher
from kvabi.routing.kv_event_subscriber import KVEventSubscriber
from kvabi.routing.prefix_index import PrefixIndex
from kvabi.server.launch import free_port

H = [bytes([i]) * 32 for i in range(4)]


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def sub_socket():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    yield sock
    sock.close(linger=0)
    ctx.term()


def test_a_plain_msgpack_zmq_subscriber_reads_the_schema(sub_socket):
    log, address = BlockEventLog(), endpoint()
    publisher = KVEventPublisher(address, log, topic="kv").start()
    try:
        sub_socket.connect(address)
        time.sleep(0.5)  # a SUB socket misses what is sent before its subscription arrives
        log.stored(UNIFORM, H[0], None, (1, 2))
        log.stored(UNIFORM, H[1], H[0], (3, 4))
        topic, seq, payload = sub_socket.recv_multipart()
        log.removed(UNIFORM, H[1])
        second = sub_socket.recv_multipart()
    finally:
        publisher.close()
    assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0)
    ts, events, rank = msgpack.unpackb(payload)
    assert abs(ts - time.time()) < 60 and rank == 0
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [H[0], H[1]],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
        }
    ]
    assert int.from_bytes(second[1], "big") == 1
    assert msgpack.unpackb(second[2])[1] == [
        {"type": "BlockRemoved", "block_hashes": [H[1]], "medium": "CPU"}
    ]


def test_replay_sends_the_kept_batches_from_a_sequence_number_then_the_end_marker():
    log, address, replay = BlockEventLog(), endpoint(), endpoint()
    publisher = KVEventPublisher(address, log, replay_endpoint=replay, buffer_steps=2).start()
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        for h in H[:3]:  # three batches, seq 0, 1, 2; the buffer keeps the last two
            log.removed(UNIFORM, h)
            deadline = time.monotonic() + 5
            while publisher.num_sent < H.index(h) + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        req.connect(replay)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [req.recv_multipart() for _ in range(3)]
    finally:
        req.close(linger=0)
        ctx.term()
        publisher.close()
    assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [1, 2]
    assert msgpack.unpackb(replies[0][3])[1][0]["block_hashes"] == [H[1]]
    assert replies[2] == [b"", b"", END_SEQ, b""]


def test_our_subscriber_feeds_the_index_and_a_restart_forgets_the_old_blocks():
    index, address = PrefixIndex(), endpoint()
    subscriber = KVEventSubscriber(address, lambda seq, b: index.apply("a", seq, b)).start()
    log = BlockEventLog()
    publisher = KVEventPublisher(address, log).start()
    try:
        time.sleep(0.5)
        log.stored(UNIFORM, H[0], None, (1, 2))
        log.stored(UNIFORM, H[1], H[0], (3, 4))
        _wait(lambda: index.num_blocks() == {"a": 2})
        assert index.match(["a", "b"], {2: H[:3]}) == {"a": 4, "b": 0}
        publisher.close()
        log = BlockEventLog()  # a restarted instance: sequence numbers start at 0 again
        publisher = KVEventPublisher(address, log).start()
        time.sleep(0.5)
        log.stored(UNIFORM, H[2], None, (5, 6))
        _wait(lambda: index.num_blocks() == {"a": 1})
        assert index.match(["a"], {2: [H[2]]}) == {"a": 2}
    finally:
        subscriber.close()
        publisher.close()


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
