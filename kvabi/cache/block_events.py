"""Block events: what the pool's index of cached blocks gained and lost, for others to follow.

Every pool reports each change to a `BlockEventSink` it is given (none: no events), naming the
block group it is of (`EventGroup`): a full block registered under its hash (`stored`), a cached
block evicted or dropped (`removed`); the cache reports its whole index emptied (`cleared`,
once, when no pool holds a cached block any more). `BlockEventLog` is the sink a publisher
drains; it merges a chain's consecutive blocks of one group into one `BlockStored` and
consecutive removals of one group into one `BlockRemoved`, the shape of vLLM's KV events
(`kvabi/routing/kv_event_codec.py` puts them on the wire).

A hybrid model's cache has several block groups (kvabi/cache/block_groups.py), each indexing its
own copy of a block: its events carry `group_idx` (the group id) and, when stored, the group's
kind and sliding window, spelled as vLLM 0.32 does (`KVCacheSpecKind`). A uniform cache's events
carry none of them (`UNIFORM`), as before: a follower reads a missing group as group 0.
Thread safe: the engine thread records, a publisher thread drains.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Protocol

from kvabi.abi.descriptor import MLA
from kvabi.cache.block_groups import GroupPlan

MEDIA = ("GPU", "CPU", "STORAGE")  # vLLM's names for where a block lives
# vLLM's `KVCacheSpecKind` values for the groups kvabi has
FULL_ATTENTION, SLIDING_WINDOW, MLA_ATTENTION = "full_attention", "sliding_window", "mla_attention"


@dataclass(frozen=True)
class EventGroup:
    """How events name a block group: `group_idx` (None: the cache's only group), its kind and
    sliding window in tokens (None: not sliding), as vLLM's events do."""

    group_idx: int | None = None
    kind: str | None = None
    sliding_window: int | None = None


UNIFORM = EventGroup()  # a cache of one full-attention group: no group fields


def event_groups(plan: GroupPlan) -> tuple[EventGroup, ...]:
    """Per block group of a cache, how its events name it: a uniform cache's carry no group
    (the bytes of vLLM's events for a model of one group, as before), a hybrid one's carry the
    group id, kind and window."""
    if plan.is_uniform:
        return (UNIFORM,)
    return tuple(
        EventGroup(g.group_id, SLIDING_WINDOW, g.window)
        if g.window
        else EventGroup(g.group_id, _kind(plan.pool_specs[g.pool_id].layers[0].kind))
        for g in plan.groups
    )


def _kind(layer_kind: str) -> str:
    return MLA_ATTENTION if layer_kind == MLA else FULL_ATTENTION


@dataclass(frozen=True)
class BlockStored:
    """A run of blocks, each chained to the one before; `parent_block_hash` is the hash the
    first one chains from (None: it starts its chain). `token_ids`: all of the run's tokens."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    group_idx: int | None = None  # the block group (None: the cache has one)
    kv_cache_spec_kind: str | None = None  # the group's kind (FULL_ATTENTION, ...)
    kv_cache_spec_sliding_window: int | None = None  # tokens, for a sliding group


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """No block of this publisher is cached any more."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockEventSink(Protocol):
    """What the pool tells of its index (called on the engine thread)."""

    def stored(
        self,
        group: EventGroup,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: tuple[int, ...],
    ) -> None: ...

    def removed(self, group: EventGroup, block_hash: bytes) -> None: ...

    def cleared(self) -> None: ...


class BlockEventLog:
    """A `BlockEventSink` that keeps the events, merged, until `drain` takes them."""

    def __init__(self, medium: str = "CPU") -> None:
        if medium not in MEDIA:
            raise ValueError(f"medium: one of {MEDIA}, got {medium!r}")
        self.medium = medium
        self._events: list[BlockEvent] = []
        self._lock = threading.Lock()
        self._pending = threading.Event()  # set while events wait to be drained

    def stored(
        self,
        group: EventGroup,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: tuple[int, ...],
    ) -> None:
        """A block of `group` registered under `block_hash`; extends the last event if that
        is of the same group and the block chains on."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if (
                isinstance(last, BlockStored)
                and last.group_idx == group.group_idx
                and parent_hash is not None
                and last.block_hashes[-1] == parent_hash
                and last.block_size == len(token_ids)
            ):
                self._events[-1] = replace(
                    last,
                    block_hashes=last.block_hashes + (block_hash,),
                    token_ids=last.token_ids + tuple(token_ids),
                )
            else:
                event = BlockStored(
                    (block_hash,),
                    parent_hash,
                    tuple(token_ids),
                    len(token_ids),
                    self.medium,
                    group.group_idx,
                    group.kind,
                    group.sliding_window,
                )
                self._events.append(event)
            self._pending.set()

    def removed(self, group: EventGroup, block_hash: bytes) -> None:
        """A cached block of `group` left the index; joins the last event if that was a
        removal of the same group too."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.group_idx == group.group_idx:
                self._events[-1] = replace(last, block_hashes=last.block_hashes + (block_hash,))
            else:
                self._events.append(BlockRemoved((block_hash,), self.medium, group.group_idx))
            self._pending.set()

    def cleared(self) -> None:
        """The index is empty: what came before no longer matters to a follower."""
        with self._lock:
            self._events = [AllBlocksCleared()]
            self._pending.set()

    def drain(self) -> list[BlockEvent]:
        """The events since the last drain, oldest first."""
        with self._lock:
            events, self._events = self._events, []
            self._pending.clear()
        return events

    def wait(self, timeout_s: float) -> bool:
        """Block until some event is pending or `timeout_s` passes; True if one is."""
        return self._pending.wait(timeout_s)
