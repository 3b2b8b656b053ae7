"""`TierWriter`: writes blocks down the tiers on a background thread; the step loop never waits.

The step loop first reserves room (`reserve`), then hands over a snapshot (a copy of the blocks,
taken before their memory is reused) and their keys; the thread copies the blocks into the host
tier's slab, and encodes each block as a container entry once for every other tier that lacks
it. Entries encoded elsewhere (vLLM's connector: its worker encodes them) are handed over as
they are (`submit_entries`) and only written. The queue is bounded in bytes of
snapshots: blocks beyond the bound are dropped before anything is copied, and counted. A lost
write-down costs a later recompute, never a wrong answer.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.block_codec import BlockCodec, narrow_blocks
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.tier import KVTier

_STOP = None
Entry = bytes | memoryview


class TierWriter:
    def __init__(self, tiers: Sequence[KVTier], codec: BlockCodec, max_queued_bytes: int):
        self.tiers = list(tiers)
        self.codec = codec
        self.max_queued_bytes = max_queued_bytes
        self.num_queued_bytes = 0
        self.num_dropped_blocks = 0
        self.num_errors = 0
        self._is_closed = False
        self._queue: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued: Counter[bytes] = Counter()  # block hash -> its entries queued, not written
        self._thread = threading.Thread(target=self._run, name="kvabi-tier-writer", daemon=True)
        self._thread.start()

    def reserve(self, num_blocks: int, block_bytes: int) -> int:
        """Room for how many of `num_blocks` blocks (the leading ones); the rest are dropped."""
        with self._lock:
            room = (self.max_queued_bytes - self.num_queued_bytes) // block_bytes
            room = 0 if self._is_closed else room
            taken = max(min(num_blocks, room), 0)
            self.num_queued_bytes += taken * block_bytes
            self.num_dropped_blocks += num_blocks - taken
        return taken

    def submit(self, blocks: CacheBuffers, keys: list[BlockKey], num_bytes: int) -> None:
        """Queue a snapshot of `len(keys)` blocks whose `num_bytes` were reserved."""
        self._queue.put((lambda: self._write(blocks, keys), num_bytes))

    def submit_entries(self, entries: Sequence[tuple[bytes, Entry]], num_bytes: int) -> None:
        """Queue encoded entries, (block hash, entry) each, whose `num_bytes` were reserved:
        each goes into every tier that lacks it. Until then `is_queued` names them."""
        hashes = [h for h, _ in entries]
        with self._lock:
            self._queued.update(hashes)

        def write() -> None:
            try:
                self._put_entries(entries)
            finally:
                with self._lock:
                    self._queued.subtract(hashes)
                    self._queued = +self._queued  # drop the zero counts

        self._queue.put((write, num_bytes))

    def is_queued(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether an entry of any of these blocks is queued (`submit_entries`), not written."""
        with self._lock:
            return any(h in self._queued for h in block_hashes)

    def flush(self) -> None:
        """Wait until everything queued so far is written (tests, benches, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread (later blocks are dropped)."""
        with self._lock:
            self._is_closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                item[0]()
            except Exception:  # a failed write-down must never stop the thread
                self.num_errors += 1
            finally:
                if item is not _STOP:
                    with self._lock:
                        self.num_queued_bytes -= item[1]
                self._queue.task_done()

    def _write(self, blocks: CacheBuffers, keys: list[BlockKey]) -> None:
        for tier in self.tiers:
            if tier.holds_blocks:
                tier.put_blocks(blocks, keys)  # one copy per buffer, no encoding
        tiers = [t for t in self.tiers if not t.holds_blocks]
        hashes = [k.block_hash for k in keys]
        missing = [[not p for p in tier.contains_many(hashes)] for tier in tiers]
        wanted = [i for i in range(len(keys)) if any(m[i] for m in missing)]
        if not wanted:
            return
        if len(wanted) < len(keys):
            blocks = narrow_blocks(blocks, wanted[0], wanted[-1] + 1 - wanted[0])
            keys = keys[wanted[0] : wanted[-1] + 1]
            missing = [m[wanted[0] : wanted[-1] + 1] for m in missing]
        entries = self.codec.encode_many(blocks, keys)  # those between wanted ones too
        for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            for tier, m in zip(tiers, missing, strict=True):
                if m[i]:
                    tier.put(key.block_hash, entry)

    def _put_entries(self, entries: Sequence[tuple[bytes, Entry]]) -> None:
        for tier in self.tiers:
            held = tier.contains_many([h for h, _ in entries])
            for (block_hash, entry), is_held in zip(entries, held, strict=True):
                if not is_held:
                    tier.put(block_hash, entry)
