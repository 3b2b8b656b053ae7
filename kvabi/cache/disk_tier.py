"""`DiskTier`: entries as container files, one per block, that survive an engine restart.

Files live in `<root>/<compat digest>/<block hash hex>.kvabi`: one folder per model, so another
model's files are never even listed (and one planted in the wrong folder fails the model check
on load and is removed). A file is written to a temporary name and renamed, so a crash never
leaves a half-written entry under a real name. The LRU order is the files' modification times
(a read touches its file), so it too survives a restart: a warm start lists the folder, oldest
first, and trims it to the capacity.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvabi.abi.block_hash import HASH_BYTES
from kvabi.cache.tier import KVTier
from kvabi.native.cpu_kernels import cpu_kernels, kernel_threads
from kvabi.wire.entries import RowSums

SUFFIX = ".kvabi"


class DiskTier(KVTier):
    name = "disk"

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, compat_digest: str):
        super().__init__(capacity_bytes)
        self.dir = Path(root) / compat_digest
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self._num_bytes = 0
        self._lock = threading.Lock()
        self._warm_start()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def path(self, block_hash: bytes) -> Path:
        """The file of this hash's entry (present or not)."""
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def _contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [h in self._index for h in block_hashes]

    def _get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(h) for h in block_hashes]

    def _put(self, block_hash: bytes, entry: bytes | memoryview) -> None:
        with self._lock:
            if block_hash in self._index:
                return
        tmp = self.dir / f".{uuid.uuid4().hex}.tmp"
        try:
            tmp.write_bytes(entry)
            os.replace(tmp, self.path(block_hash))
            _touch(self.path(block_hash))
        except OSError:
            tmp.unlink(missing_ok=True)
            self.stats.add(failures=1)
            return
        with self._lock:
            self._index[block_hash] = len(entry)
            self._num_bytes += len(entry)
            victims = self._trim()
        self._unlink(victims)
        self.stats.add(writes=1, write_bytes=len(entry), evictions=len(victims))

    def _remove(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._num_bytes -= size
        self._unlink([block_hash])

    def _read_rows(
        self, block_hashes: Sequence[bytes], rows: np.ndarray, sums: RowSums | None
    ) -> int:
        """Each file read straight into its row (no bytes object: no copy, no fresh pages); by
        the kernels where built, all of them in one call, on every thread, without the GIL,
        each file's checksums (`sums`) taken right after it is read, while in cache."""
        size, hashes = rows.shape[1], []
        with self._lock:
            for block_hash in block_hashes[: len(rows)]:
                if self._index.get(block_hash) != size:
                    break  # absent, or not an entry of this size
                self._index.move_to_end(block_hash)
                hashes.append(block_hash)
        kernels = cpu_kernels()
        if kernels is None or not kernels.reads_files or not rows.flags.c_contiguous:
            return self._read_each(hashes, rows)
        paths = [str(self.path(h)) for h in hashes]
        spans = sums.spans if sums is not None else None
        got, taken = kernels.read_files(paths, rows, time.time_ns(), kernel_threads(), spans)
        if sums is not None:
            sums.out = taken
        n = 0
        for block_hash, g in zip(hashes, got, strict=True):
            if g < 0:  # evicted or deleted under us: a miss
                self.remove(block_hash)
            if g != size:
                break  # changed under us: the entry-by-entry path reads it and says what
            n += 1
        return n

    def _read_each(self, hashes: list[bytes], rows: np.ndarray) -> int:
        """`_read_rows` without the kernels: a file at a time."""
        n, size = 0, rows.shape[1]
        for block_hash in hashes:
            path = self.path(block_hash)
            try:
                with open(path, "rb", buffering=0) as f:
                    got = f.readinto(memoryview(rows[n]))
                _touch(path)
            except OSError:  # evicted or deleted under us: a miss
                self.remove(block_hash)
                break
            if got != size:
                break  # changed under us: the entry-by-entry path reads it and says what
            n += 1
        return n

    def _get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        path = self.path(block_hash)
        try:
            entry = path.read_bytes()
            _touch(path)
        except OSError:  # evicted or deleted under us: a miss
            self.remove(block_hash)
            return None
        return entry

    def _warm_start(self) -> None:
        found = []
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # an interrupted write
                continue
            block_hash = _parse_name(path.name)
            if block_hash is not None and path.is_file():
                st = path.stat()
                found.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._num_bytes += size
        self._unlink(self._trim())

    def _trim(self) -> list[bytes]:
        """Drop least recent entries from the index until under capacity (caller holds lock)."""
        victims = []
        while self._num_bytes > self.capacity_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self._num_bytes -= size
            victims.append(block_hash)
        return victims

    def _unlink(self, block_hashes: list[bytes]) -> None:
        for h in block_hashes:
            self.path(h).unlink(missing_ok=True)


def _touch(path: Path) -> None:
    """Stamp the file with the current time, finer than the file system's own clock tick: the
    LRU order lives in these times, across restarts."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _parse_name(name: str) -> bytes | None:
    stem = name.removesuffix(SUFFIX)
    if stem == name or len(stem) != 2 * HASH_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None
