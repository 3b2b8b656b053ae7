"""An all-reduce through shared memory for tensor-parallel ranks on one host.

Gloo's all-reduce of a small tensor between two processes costs about a millisecond here
(TCP on loopback), twice per layer per step. Ranks on one machine can instead meet in a
shared file under /dev/shm: per rank a flag and two slots (rounds alternate between them).

Round k: each rank copies its partial output into its slot of buffer k % 2, then sets its
flag to k; once every flag reads k or more, each rank sums the slots in rank order (the same
order on every rank, so their residual streams stay bit-identical) into its tensor. A rank
writes buffer k % 2 again only in round k + 2, after every flag reached k + 1, which each
rank sets only once it has read round k: one barrier per all-reduce.

No fence orders a slot's bytes before its flag: the copies are torch's ordinary vector stores
and loads, which x86 (total store order) keeps in program order. A weakly ordered CPU (Arm)
would need a release store and an acquire load here; kvabi's machines are x86.

The file is unlinked as soon as every rank has mapped it (after the first round completes,
which every rank reaches only once attached), so a rank killed later leaves nothing behind.

A wait spins (yielding the CPU) until its deadline; past it, or as soon as `alive()` says a
peer is gone, it raises `ShmTimeout`. A tensor larger than a slot goes through gloo instead
(every rank decides alike: the ranks reduce tensors of the same size).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

FLAG_STRIDE = 64  # bytes between two ranks' flags (one cache line each)
SLOT_BYTES = 4 * 2**20  # per rank per buffer: 512 tokens of a 2,048-wide fp32 row


class ShmTimeout(RuntimeError):
    """A peer did not reach the barrier in time, or is gone."""


def shm_path(tag: str) -> Path:
    return Path("/dev/shm") / f"kvabi-tp-{tag}"


def shm_bytes(size: int) -> int:
    return FLAG_STRIDE * size + 2 * size * SLOT_BYTES


class ShmAllReduce:
    """One rank's view of the shared file (`create` it on rank 0 before the others attach)."""

    def __init__(self, path: Path, rank: int, size: int, timeout_s: float) -> None:
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), shm_bytes(size))
        words = FLAG_STRIDE // 8
        self._flags = np.frombuffer(self._map, np.int64, size * words)[::words]
        self._round = 0
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.owner = False  # rank 0: unlinks the file once every rank has mapped it
        self.alive: Callable[[], bool] = lambda: True

    @classmethod
    def create(cls, tag: str, size: int, timeout_s: float) -> ShmAllReduce:
        path = shm_path(tag)
        with path.open("wb") as f:
            f.truncate(shm_bytes(size))
        own = cls(path, 0, size, timeout_s)
        own.owner = True
        return own

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.is_contiguous() and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' sum of `tensor`, in place (the caller checked `fits`)."""
        self._round += 1
        k, buf, n = self._round, self._round % 2, tensor.numel()
        flat = tensor.view(-1)
        self._slot(buf, self.rank, tensor.dtype)[:n].copy_(flat)
        self._flags[self.rank] = k
        self._wait(k)
        if self.owner and k == 1:  # every rank has mapped the file: it needs no name
            self.path.unlink(missing_ok=True)
        flat.copy_(self._slot(buf, 0, tensor.dtype)[:n])
        for r in range(1, self.size):
            flat.add_(self._slot(buf, r, tensor.dtype)[:n])
        return tensor

    def _slot(self, buf: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        key = (buf, rank, dtype)
        view = self._views.get(key)
        if view is None:
            offset = FLAG_STRIDE * self.size + (buf * self.size + rank) * SLOT_BYTES
            count = SLOT_BYTES // dtype.itemsize
            view = torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
            self._views[key] = view
        return view

    def _wait(self, k: int) -> None:
        flags, spins = self._flags, 0
        deadline = time.monotonic() + self.timeout_s
        while flags.min() < k:
            spins += 1
            if spins > 64:
                os.sched_yield()
            if spins % 4096 == 0:
                if not self.alive():
                    raise ShmTimeout("tp: a rank is gone")
                if time.monotonic() > deadline:
                    raise ShmTimeout(f"tp: no rank reached all-reduce {k} in {self.timeout_s} s")

    def close(self, unlink: bool = False) -> None:
        self._views.clear()  # the map closes only once no view exports its buffer
        self._flags = np.zeros(self.size, np.int64)
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)
