"""`BlockHasher`: the one place a prompt's blocks get their names (docs/ABI.md, section 4).

A request's tokens are split into blocks of `block_size`; block i's hash chains block i-1's from
a root that binds the model's compat digest and the request's `cache_salt` (`request_root`), so
tenants never share a block and a hash names the whole prefix. The engine, its tiers, the
prefill/decode roles, the KV-event route and the vLLM connector all hash through this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvabi.abi.block_hash import hash_block, request_root

MAX_ROOTS = 4096  # memoised roots (one per cache_salt seen)


@dataclass(frozen=True)
class BlockKey:
    """What a cached block holds: its chained block hash and its own tokens; `parent_hash`,
    the hash it chains from (None for a chain's first block, or unknown), is only reported."""

    block_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None = field(default=None, compare=False, repr=False)


class BlockHasher:
    def __init__(self, compat_digest: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.compat_digest = compat_digest
        self.block_size = block_size
        self._roots: dict[str | None, bytes] = {}

    def root(self, cache_salt: str | None = None) -> bytes:
        """A request's chain root (`request_root`; memoised: a few tenants, many requests;
        bounded, so clients sending fresh salts cannot grow it). An empty salt is refused
        (ValueError), never read as "no salt"."""
        if cache_salt not in self._roots:
            if len(self._roots) >= MAX_ROOTS:
                self._roots.clear()
            self._roots[cache_salt] = request_root(self.compat_digest, cache_salt)
        return self._roots[cache_salt]

    def extend(self, hashes: list[bytes], root: bytes, token_ids: Sequence[int]) -> None:
        """Append to `hashes` the hashes of the full blocks of `token_ids` it lacks (a growing
        sequence hashes each block once)."""
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids`."""
        out: list[bytes] = []
        self.extend(out, self.root(cache_salt), token_ids)
        return out

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockKey]:
        """Each full block's key: its hash, its tokens and its parent."""
        hashes = self.hashes(token_ids, cache_salt)
        return self.keys_of(hashes, token_ids, 0, len(hashes))

    def keys_of(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], start: int, stop: int
    ) -> list[BlockKey]:
        """The keys of blocks `start .. stop-1` of a chain whose hashes (from block 0) and
        tokens are given."""
        bs = self.block_size
        return [
            BlockKey(
                hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]), hashes[i - 1] if i else None
            )
            for i in range(start, stop)
        ]
