"""`PrefixIndex`: which instance holds which block, built from the instances' KV events.

`apply` takes one instance's batch: `BlockStored` adds its hashes, `BlockRemoved` drops them,
`AllBlocksCleared` drops all of that instance's. A batch whose sequence number does not follow
the last one seen means the publisher restarted (lower or equal: it counts from 0 again, and its
cache is empty) or batches were lost (higher: logged; a stale entry only costs a worse route).
`match` tells, for a request's block hashes, how many leading tokens each instance holds.
Thread safe: subscriber threads apply, the router's event loop matches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from kvabi.cache.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvabi.routing.kv_event_codec import EventBatch

log = logging.getLogger("kvabi.router")


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[bytes]] = {}  # instance -> the hashes it holds
        self._block_sizes: dict[str, int] = {}  # instance -> its block size (from its events)
        self._last_seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def apply(self, instance: str, seq: int, batch: EventBatch) -> None:
        """Follow one batch of `instance`'s events (see the module doc for `seq`)."""
        with self._lock:
            last = self._last_seq.get(instance)
            if last is not None and seq <= last:
                log.info(
                    "%s: event sequence restarted (%d after %d); forgetting it", instance, seq, last
                )
                self._blocks.pop(instance, None)
            elif last is not None and seq > last + 1:
                log.warning("%s: missed %d event batches", instance, seq - last - 1)
            self._last_seq[instance] = seq
            held = self._blocks.setdefault(instance, set())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                    self._block_sizes[instance] = event.block_size
                elif isinstance(event, BlockRemoved):
                    held.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    held.clear()

    def forget(self, instance: str) -> None:
        """Drop all that is known of `instance` (it went away)."""
        with self._lock:
            self._blocks.pop(instance, None)
            self._last_seq.pop(instance, None)

    def block_sizes(self) -> set[int]:
        """The block sizes the instances hash with (a request is hashed once per size)."""
        with self._lock:
            return set(self._block_sizes.values())

    def num_blocks(self) -> dict[str, int]:
        """How many blocks each followed instance holds."""
        with self._lock:
            return {instance: len(held) for instance, held in self._blocks.items()}

    def match(
        self, instances: Iterable[str], hashes_by_size: Mapping[int, Sequence[bytes]]
    ) -> dict[str, int]:
        """Each instance's cached prefix in tokens: the leading run of the request's block
        hashes (for that instance's block size) it holds, times its block size."""
        with self._lock:
            return {i: self._match_one(i, hashes_by_size) for i in instances}

    def _match_one(self, instance: str, hashes_by_size: Mapping[int, Sequence[bytes]]) -> int:
        held, size = self._blocks.get(instance), self._block_sizes.get(instance)
        if not held or size not in hashes_by_size:
            return 0
        n = 0
        for h in hashes_by_size[size]:
            if h not in held:
                break
            n += 1
        return n * size
