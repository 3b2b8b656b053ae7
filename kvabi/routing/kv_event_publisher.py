"""`KVEventPublisher`: a cache's block events out on a ZMQ PUB socket, as vLLM publishes them.

A thread drains a `BlockEventLog` and sends each batch as three frames: the topic, the
batch's sequence number (8 bytes, big-endian, from 0), and the msgpack payload
(`kv_event_codec`: vLLM's named-field events, or with `form="array"` the positional form
older consumers decode). It keeps the last `buffer_steps` batches: with a replay endpoint (a ROUTER
socket), a follower that sends `[b"", start_seq as 8 bytes big-endian]` gets every kept batch
from `start_seq` as `[b"", topic, seq, payload]`, then `[b"", b"", -1 as 8 bytes, b""]`, the
end marker (vLLM's replay protocol), so one that joined late or saw a gap catches up.
The sockets bind (a follower connects); only the publisher's thread touches them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from kvabi.cache.block_events import BlockEventLog
from kvabi.routing.kv_event_codec import EVENT_FORMS, encode_batch

log = logging.getLogger("kvabi.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        events: BlockEventLog,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        form: str = "map",
    ) -> None:
        if form not in EVENT_FORMS:
            raise ValueError(f"KV event form must be one of {EVENT_FORMS}, got {form!r}")
        self.endpoint, self.replay_endpoint, self.form = endpoint, replay_endpoint, form
        self.events, self.topic = events, topic.encode()
        self.num_sent = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)  # fails here, at start-up, when the port is taken
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvabi-kv-events", daemon=True)

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def close(self) -> None:
        """Send what is pending, stop the thread, close the sockets (once)."""
        if self._ctx.closed:
            return
        self._running = False
        if self._thread.is_alive():
            self._thread.join(5.0)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)
        self._ctx.term()

    def _run(self) -> None:
        while self._running:
            if self.events.wait(0.05):
                self._publish()
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
        self._publish()

    def _publish(self) -> None:
        batch = self.events.drain()
        if not batch:
            return
        seq, payload = self.num_sent, encode_batch(batch, time.time(), form=self.form)
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_sent += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
