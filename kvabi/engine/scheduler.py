"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences go first, oldest first, each taking what it still
needs (1 token when decoding, the rest of its prompt when prefilling, cut to the budget); then
waiting sequences are admitted oldest first while the budget, `max_num_seqs` and free blocks
allow. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the waiting queue, to be recomputed later.

With a prefix cache, admitting a sequence first matches its full blocks against the pool by
block hash: matched blocks are shared (ref counts up) and only the rest is prefilled; blocks
a step fills are indexed (`cache_computed`) so later requests find them. A sequence about to
write into a block it does not own alone (shared with a fork, or cached: a full-prompt hit
recomputes its last token) first gets a private copy: the batch lists these copies
(`BlockCopy`) and the engine makes them before the forward.
Pure Python over ids; the one object handed to the runner is `ScheduledBatch`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.kv_cache import NO_MATCH, KVCache, MatchResult
from kvabi.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= seq.num_computed before it)
    num_tokens: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """Whether this step brings the sequence level with its tokens, so it samples next."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class BlockCopy:
    """Copy block `src` into block `dst` before the step's forward (copy on write)."""

    src: int
    dst: int


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCache) -> None:
        self.config = config
        self.cache, self.pool, self.stats = cache, cache.pool, cache.stats
        self.block_size = cache.block_size
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0
        self._copies: list[BlockCopy] = []

    def add(self, seq: Sequence) -> None:
        seq.status, seq.is_promoted = SeqStatus.WAITING, False
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence that already holds blocks (a fork of a running one)."""
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._copies = []
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, n, preempted):
                continue
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self._match(seq)
            n = min(seq.num_tokens - hit.num_cached_tokens, budget)
            if preempted or not self._can_admit(hit, n):
                break  # admit nothing while memory is short: it would only be preempted again
            self.waiting.pop(0)
            self._admit(seq, hit)
            self._allocate(seq, n)
            self.add_running(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return ScheduledBatch(tuple(scheduled), tuple(preempted), tuple(self._copies))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []

    def cache_computed(self, seq: Sequence) -> None:
        """Index the sequence's blocks that are now full and computed (after a step)."""
        full = min(seq.num_computed // self.block_size, len(seq.block_ids))
        if not self.cache.is_prefix_caching or full <= seq.num_cached_blocks:
            return
        hashes = self.block_hashes(seq)
        self.cache.cache_blocks(seq.block_ids, hashes, seq.token_ids(), seq.num_cached_blocks, full)
        seq.num_cached_blocks = full

    def block_hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of the sequence's full blocks (computed once, extended as it
        grows); the root binds the model and the request's cache salt."""
        if seq.hash_root is None:
            seq.hash_root = self.cache.hasher.root(seq.params.cache_salt)
        tokens = seq.token_ids()
        if len(seq.block_hashes) < len(tokens) // self.block_size:
            self.cache.hasher.extend(seq.block_hashes, seq.hash_root, tokens)
        return seq.block_hashes

    def block_keys(self, seq: Sequence) -> list[BlockKey]:
        """Each full block's key (hash and tokens): what the lower tiers are searched for."""
        hashes = self.block_hashes(seq)
        return self.cache.hasher.keys_of(hashes, seq.token_ids(), 0, len(hashes))

    def _match(self, seq: Sequence) -> MatchResult:
        if not self.cache.is_prefix_caching:
            return NO_MATCH
        return self.cache.match(self.block_hashes(seq), seq.num_tokens)

    def _can_admit(self, hit: MatchResult, n: int) -> bool:
        copy = 1 if hit.num_cached_tokens % self.block_size else 0  # a partly reused block
        new = -(-(hit.num_cached_tokens + n) // self.block_size) - len(hit.block_ids) + copy
        return new + self.pool.num_free_of(hit.block_ids) <= self.pool.num_free

    def _admit(self, seq: Sequence, hit: MatchResult) -> None:
        self.pool.touch(hit.block_ids)
        seq.block_ids = list(hit.block_ids)
        seq.num_computed = hit.num_cached_tokens
        seq.num_cached_blocks = len(hit.block_ids)
        if not seq.is_counted:
            self.stats.record_query(seq.params.tag, seq.num_tokens, hit.num_cached_tokens)
            seq.is_counted = True

    def _reserve(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        while not self.pool.can_allocate(self._blocks_needed(seq, n)):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self._allocate(seq, n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.num_computed, seq.num_cached_blocks = [], 0, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.block_size)
        return total - len(seq.block_ids) + self._needs_copy(seq)

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether the next token's block is one the sequence may not write (shared, cached)."""
        i = seq.num_computed // self.block_size
        return i < len(seq.block_ids) and not self.pool.is_writable(seq.block_ids[i])

    def _allocate(self, seq: Sequence, n: int) -> None:
        if self._needs_copy(seq):
            self._copy_on_write(seq)
        seq.block_ids += self.pool.allocate(max(self._blocks_needed(seq, n), 0))

    def _copy_on_write(self, seq: Sequence) -> None:
        """Swap the block about to be written for a private copy. The source is released at
        once: even if reused this step, the engine copies before anything writes."""
        i = seq.num_computed // self.block_size
        src = seq.block_ids[i]
        (dst,) = self.pool.allocate(1)
        self._copies.append(BlockCopy(src, dst))
        seq.block_ids[i] = dst
        self.pool.free([src])
        self.stats.num_cow_copies += 1
