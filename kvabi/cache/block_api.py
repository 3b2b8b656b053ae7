"""The value types of `KVCache`'s block API: a prefix match, a fetch request, a payload of
blocks, blocks lent out of the pool or reserved in it for a peer's READ, an import's result
(kvabi/cache/kv_cache.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.cache.block_hasher import BlockKey


@dataclass(frozen=True)
class MatchResult:
    """The cached prefix of a request: its tokens and, per block group, the pool blocks
    holding them (`NULL_BLOCK` where a sliding group's window no longer needs a block)."""

    num_cached_tokens: int
    block_tables: tuple[tuple[int, ...], ...]

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The first group's blocks (a uniform model's only group)."""
        return self.block_tables[0] if self.block_tables else ()

    def table(self, group_id: int) -> tuple[int, ...]:
        return self.block_tables[group_id] if self.block_tables else ()


NO_MATCH = MatchResult(0, ())
NULL_BLOCK = -1  # a sliding group's table entry for a block that left the window


def held_blocks(table: Sequence[int]) -> list[int]:
    """A block table's blocks, without the entries a sliding window released."""
    return [b for b in table if b != NULL_BLOCK]


@dataclass(frozen=True)
class FetchRequest:
    """KV wanted for `token_ids` (a whole prompt) from token `start_token` on; the blocks
    before it the asker already holds. `start_token` is a multiple of both block sizes."""

    token_ids: tuple[int, ...]
    start_token: int = 0
    cache_salt: str | None = None
    reads_blocks: bool = False  # the asker READs them out of the pool: answer with a KVLoan


@dataclass(frozen=True)
class KVPayload:
    """Blocks of a prompt's KV: tokens `start_token .. start_token + len(token_ids) - 1` in
    the sender's layout (`cache.extent` blocks), with the sender's block hashes of them."""

    start_token: int
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    cache: CacheBuffers

    @property
    def end_token(self) -> int:
        """One past the last token whose KV the payload holds."""
        return self.start_token + len(self.token_ids)


@dataclass(frozen=True)
class ImportResult:
    """What an import did: tokens the pool now holds for the prompt, blocks newly placed."""

    num_cached_tokens: int
    num_placed_blocks: int


@dataclass(frozen=True)
class KVLoan:
    """Blocks of a prompt's KV lent straight out of a pool (tokens as in `KVPayload`): block
    i of them is pool block `block_ids[i]` of `buffers` (the pool's whole buffers). They stay
    pinned, neither evicted nor written, until `release()`, which the borrower calls once."""

    start_token: int
    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    buffers: CacheBuffers
    block_ids: tuple[int, ...]
    release: Callable[[], None]

    def to_payload(self) -> KVPayload:
        """A copy of the lent blocks (for a transport that cannot READ them); releases."""
        try:
            n = len(self.token_ids)
            ids = self.block_ids
            cache = convert(self.buffers, self.buffers.desc, num_tokens=n, src_block_ids=ids)
        finally:
            self.release()
        return KVPayload(self.start_token, self.token_ids, self.block_hashes, cache)


@dataclass(frozen=True)
class BlockReservation:
    """Free pool blocks taken for a prompt's blocks from `start_token` on, for a peer to write
    (`block_ids[i]` gets block `start_token / block_size + i`), then `KVCache.commit`ted or
    `cancel`led; the pooled prefix before them (`pooled`) is pinned meanwhile."""

    start_token: int
    block_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]  # the blocks' keys, as `block_ids`
    pooled: tuple[int, ...]
    hashes: tuple[bytes, ...]  # the prompt's block hashes up to the last reserved one
    buffers: CacheBuffers  # the pool's whole buffers
