"""`PrefixIndex`: which instance holds which block, built from the instances' KV events.

`apply` takes one instance's batch: `BlockStored` adds its hashes, `BlockRemoved` drops them,
`AllBlocksCleared` drops all of that instance's. A batch whose sequence number does not follow
the last one seen means the publisher restarted (lower or equal: it counts from 0 again, and its
cache is empty) or batches were lost (higher: logged; a stale entry only costs a worse route).

A hybrid engine's events name their block group (`group_idx`; none: group 0, as from a uniform
engine or an older publisher), so the index keeps one set of hashes per (instance, group), and
learns each group's sliding window from its stored events (none: full attention; so are kinds
without a window, such as MLA). A sliding group's removals (its window moved on) touch only that
group's set, never a prefix the full group still holds.
`match` tells, for a request's block hashes, how many leading tokens each instance can reuse,
by vLLM's hybrid rule (kvabi/cache/group_blocks.py `held_run`): the longest prefix of h blocks
that every full-attention group holds all of and every sliding group of window W holds the
blocks of from `window_start(W, h * block_size)` on (a model of sliding groups only: that alone).
Thread safe: subscriber threads apply, the router's event loop matches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvabi.abi.kv_groups import window_start
from kvabi.cache.block_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvabi.routing.kv_event_codec import EventBatch

log = logging.getLogger("kvabi.router")


@dataclass
class HeldGroup:
    """One instance's block group as its events tell it."""

    window: int = 0  # tokens; 0 = full attention (until a stored event says otherwise)
    hashes: set[bytes] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
        self._groups: dict[str, dict[int, HeldGroup]] = {}  # instance -> group -> what it holds
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
                self._groups.pop(instance, None)
            elif last is not None and seq > last + 1:
                log.warning("%s: missed %d event batches", instance, seq - last - 1)
            self._last_seq[instance] = seq
            groups = self._groups.setdefault(instance, {})
            for event in batch.events:
                self._apply_one(instance, groups, event)

    def _apply_one(self, instance: str, groups: dict[int, HeldGroup], event: BlockEvent) -> None:
        if isinstance(event, BlockStored):
            group = groups.setdefault(event.group_idx or 0, HeldGroup())
            group.window = event.kv_cache_spec_sliding_window or 0
            group.hashes.update(event.block_hashes)
            self._block_sizes[instance] = event.block_size
        elif isinstance(event, BlockRemoved):
            group = groups.get(event.group_idx or 0)  # a group never stored holds nothing
            if group is not None:
                group.hashes.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            groups.clear()

    def forget(self, instance: str) -> None:
        """Drop all that is known of `instance` (it went away)."""
        with self._lock:
            self._groups.pop(instance, None)
            self._last_seq.pop(instance, None)

    def block_sizes(self) -> set[int]:
        """The block sizes the instances hash with (a request is hashed once per size)."""
        with self._lock:
            return set(self._block_sizes.values())

    def num_blocks(self) -> dict[str, int]:
        """How many blocks each followed instance holds (every group's)."""
        with self._lock:
            return {i: sum(len(g.hashes) for g in gs.values()) for i, gs in self._groups.items()}

    def match(
        self, instances: Iterable[str], hashes_by_size: Mapping[int, Sequence[bytes]]
    ) -> dict[str, int]:
        """Each instance's reusable prefix in tokens (the module doc's rule) of the request's
        block hashes for that instance's block size, times its block size."""
        with self._lock:
            return {i: self._match_one(i, hashes_by_size) for i in instances}

    def _match_one(self, instance: str, hashes_by_size: Mapping[int, Sequence[bytes]]) -> int:
        groups, size = self._groups.get(instance), self._block_sizes.get(instance)
        if not groups or size not in hashes_by_size:
            return 0
        hashes = hashes_by_size[size]
        full = [g.hashes for g in groups.values() if not g.window]
        n = min((_leading_run(held, hashes) for held in full), default=len(hashes))
        sliding = [g for g in groups.values() if g.window]
        for h in range(n, 0, -1):
            if all(_holds_window(g, hashes, h, size) for g in sliding):
                return h * size
        return 0


def _leading_run(held: set[bytes], hashes: Sequence[bytes]) -> int:
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


def _holds_window(group: HeldGroup, hashes: Sequence[bytes], h: int, size: int) -> bool:
    """Whether a sliding group holds the blocks its window needs for a prefix of `h` blocks."""
    first = window_start(group.window, h * size) // size
    return all(hashes[i] in group.hashes for i in range(first, h))
