"""`PrefixCache`: a sequence's full blocks named by the ABI block hash, matched against the pool.

A request's tokens are split into blocks of `block_size`; block i's hash chains block i-1's
(docs/ABI.md, section 4) from a root that binds the model's compat digest and the request's extra
keys (`cache_salt`, adapter), so tenants never share a block and a hash names the whole prefix.
`match` walks the hashes from the first block and stops at the first one the pool does not hold:
the run it found is reused (ref counts up), only the rest is prefilled. At least one token is
always left to compute, because its logits choose the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvabi.abi.block_hash import hash_block, request_root
from kvabi.cache.block_pool import BlockKey, BlockPool


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a request: its tokens and the pool blocks holding them."""

    num_cached_tokens: int
    block_ids: tuple[int, ...]


NO_MATCH = MatchResult(0, ())


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, compat_digest: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.compat_digest = compat_digest
        self._roots: dict[str | None, bytes] = {}

    def root(self, cache_salt: str | None = None) -> bytes:
        """A request's chain root (`request_root`; memoised: a few tenants, many requests)."""
        if cache_salt not in self._roots:
            self._roots[cache_salt] = request_root(self.compat_digest, cache_salt)
        return self._roots[cache_salt]

    def extend_hashes(self, hashes: list[bytes], root: bytes, token_ids: Sequence[int]) -> None:
        """Append to `hashes` the hashes of the full blocks of `token_ids` it lacks."""
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))

    def keys(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], parent: bytes | None = None
    ) -> list[BlockKey]:
        """Each hashed block's key: its hash, its tokens and its parent (the hash before it in
        `hashes`; `parent` for the first, None when `hashes` starts the chain)."""
        bs = self.block_size
        parents = [parent, *hashes[:-1]]
        return [
            BlockKey(h, tuple(token_ids[i * bs : (i + 1) * bs]), parents[i])
            for i, h in enumerate(hashes)
        ]

    def num_pooled(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of `hashes` the pool holds."""
        for n, h in enumerate(hashes):
            if self.pool.cached_block(h) is None:
                return n
        return len(hashes)

    def match(self, hashes: Sequence[bytes], num_tokens: int) -> MatchResult:
        """The longest pooled prefix of a sequence of `num_tokens` tokens, capped at
        `num_tokens - 1` tokens. A capped last block is still returned: the caller copies it
        on write (it is cached, so it must not change) and recomputes only the last token."""
        n = self.num_pooled(hashes)
        num_cached = min(n * self.block_size, num_tokens - 1)
        if num_cached <= 0:
            return NO_MATCH
        n = -(-num_cached // self.block_size)
        return MatchResult(num_cached, tuple(self.pool.cached_block(h) for h in hashes[:n]))

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        stop: int,
    ) -> None:
        """Index a sequence's blocks `start .. stop-1` (full and computed) under their keys."""
        bs = self.block_size
        for i in range(start, stop):
            parent = hashes[i - 1] if i > 0 else None
            key = BlockKey(hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]), parent)
            self.pool.cache_block(block_ids[i], key)

    def pooled_blocks(self, hashes: Sequence[bytes]) -> list[int]:
        """The pool blocks still holding any of these hashes, in the given order."""
        found = (self.pool.cached_block(h) for h in hashes)
        return [b for b in found if b is not None]
