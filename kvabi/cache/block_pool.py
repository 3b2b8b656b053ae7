"""`BlockPool`: fixed-size KV blocks by integer id, with ref counts and an O(1) free list.

Pure bookkeeping over ids; the tensors live in `KVStorage`. A block is free when its ref count
is 0. Allocation takes from the front of the free queue and freeing appends to the back, so the
least recently freed block is reused first (the order the prefix cache will evict in).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (callers check first)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to each block (a forked sequence reads the same blocks)."""
        for i in block_ids:
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} is free; only held blocks can be shared")
            self.ref_counts[i] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free queue.

        Freed in reverse so a sequence's tail blocks are reused before its head blocks."""
        for i in reversed(block_ids):
            if self.ref_counts[i] < 1:
                raise ValueError(f"block {i} freed twice")
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self._free.append(i)
