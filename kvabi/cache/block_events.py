"""Block events: what the pool's index of cached blocks gained and lost, for others to follow.

The pool reports each change to a `BlockEventSink` it is given (none: no events): a full block
registered under its hash (`stored`), a cached block evicted or dropped (`removed`), the whole
index emptied (`cleared`). `BlockEventLog` is the sink a publisher drains; it merges a chain's
consecutive blocks into one `BlockStored` and consecutive removals into one `BlockRemoved`, the
shape of vLLM's KV events (`kvabi/routing/kv_event_codec.py` puts them on the wire).
Thread safe: the engine thread records, a publisher thread drains.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Protocol

MEDIA = ("GPU", "CPU", "STORAGE")  # vLLM's names for where a block lives


@dataclass(frozen=True)
class BlockStored:
    """A run of blocks, each chained to the one before; `parent_block_hash` is the hash the
    first one chains from (None: it starts its chain). `token_ids`: all of the run's tokens."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """No block of this publisher is cached any more."""


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockEventSink(Protocol):
    """What the pool tells of its index (called on the engine thread)."""

    def stored(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

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
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> None:
        """A block registered under `block_hash`; extends the last event if it chains on."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if (
                isinstance(last, BlockStored)
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
                    (block_hash,), parent_hash, tuple(token_ids), len(token_ids), self.medium
                )
                self._events.append(event)
            self._pending.set()

    def removed(self, block_hash: bytes) -> None:
        """A cached block left the index; joins the last event if that was a removal too."""
        with self._lock:
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved):
                self._events[-1] = replace(last, block_hashes=last.block_hashes + (block_hash,))
            else:
                self._events.append(BlockRemoved((block_hash,), self.medium))
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
