"""`KVEventSubscriber`: follows one publisher's KV events (ZMQ SUB) on a thread of its own.

Each batch (`[topic, seq, payload]` frames, `kv_event_publisher`) is decoded and handed to
`on_batch(seq, batch)`; a payload that does not decode is logged and skipped. The SUB socket
connects, so a publisher that starts late or restarts is picked up when it (re)binds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvabi.routing.kv_event_codec import EventBatch, EventDecodeError, decode_batch

log = logging.getLogger("kvabi.kv_events")


class KVEventSubscriber:
    def __init__(
        self, endpoint: str, on_batch: Callable[[int, EventBatch], None], topic: str = ""
    ) -> None:
        self.endpoint, self.on_batch = endpoint, on_batch
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvabi-kv-follow", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._ctx.closed:
            return
        self._running = False
        if self._thread.is_alive():
            self._thread.join(2.0)
        self._sub.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while self._running:
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("%s: ignoring a message of %d frames", self.endpoint, len(frames))
                continue
            try:
                batch = decode_batch(frames[2])
            except EventDecodeError as exc:
                log.warning("%s: %s", self.endpoint, exc)
                continue
            try:
                self.on_batch(int.from_bytes(frames[1], "big"), batch)
            except Exception:
                log.exception("%s: handling a batch failed", self.endpoint)
