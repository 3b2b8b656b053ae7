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

A hybrid model's sequences have one block table per block group (kvabi/cache/block_groups.py);
every step allocates, copies and frees per group, and counts free blocks per pool. A sliding
group releases the blocks its window no longer reaches before each step (their table entries
become `NULL_BLOCK`; cached ones stay in the prefix cache until evicted).
Pure Python over ids; the one object handed to the runner is `ScheduledBatch`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from kvabi.cache.block_groups import BlockGroup
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.kv_cache import NO_MATCH, NULL_BLOCK, KVCache, MatchResult, held_blocks
from kvabi.engine.sequence import SeqStatus, Sequence
from kvabi.engine.spec_decode import Proposer


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
    num_tokens: int  # tokens computed this step (the draft's among them)
    draft: tuple[int, ...] = ()  # draft tokens verified after the last one (spec_decode.py)

    @property
    def samples(self) -> bool:
        """Whether this step brings the sequence level with its tokens, so it samples next."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(frozen=True)
class BlockCopy:
    """Copy block `src` into block `dst` of pool `pool_id` before the step's forward (copy
    on write)."""

    src: int
    dst: int
    pool_id: int = 0


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCache,
        proposer: Proposer | None = None,
        max_model_len: int = 0,
        spec_max_batch: int = 0,
        window_slack: int = 0,
        can_draft: Callable[[Sequence], bool] | None = None,
    ) -> None:
        self.config = config
        self.proposer, self.max_model_len = proposer, max_model_len
        self.spec_max_batch = spec_max_batch  # speculate while at most this many run
        # keys a sliding group keeps before its window (a drafter reading further back)
        self.window_slack = window_slack
        self.can_draft = can_draft  # whether a sequence can draft now (default: any can)
        self.cache, self.pools, self.stats = cache, cache.pools, cache.stats
        self.groups: tuple[BlockGroup, ...] = cache.groups
        self.block_size = cache.block_size
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0
        self._copies: list[BlockCopy] = []

    def add(self, seq: Sequence) -> None:
        seq.status, seq.is_promoted, seq.is_loading = SeqStatus.WAITING, False, False
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
            self._release_window(seq)  # before counting what it needs
            n = press_chunk(seq, min(seq.num_tokens - seq.num_computed, budget))
            if n == 0:  # a press's last window does not fit this step's budget
                continue
            draft = self._draft(seq, budget) if n == 1 else ()
            if not self._reserve(seq, n + len(draft), preempted):
                continue
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n + len(draft), draft))
            budget -= n + len(draft)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.is_loading:
                continue  # its prefix is on its way up from a lower tier: the next one goes
            hit = self._match(seq)
            n = press_chunk(seq, min(seq.num_tokens - hit.num_cached_tokens, budget))
            if n == 0 or preempted or not self._can_admit(hit, n):
                break  # admit nothing while memory is short: it would only be preempted again
            self.waiting.remove(seq)
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
        self._free_tables(seq)

    def share_blocks(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` (a fork) the parent's block tables, one more reference per block."""
        child.block_tables = [list(t) for t in parent.block_tables]
        for g, table in zip(self.groups, child.block_tables, strict=True):
            self.pools[g.pool_id].share(held_blocks(table))

    def cache_computed(self, seq: Sequence) -> None:
        """Index the sequence's blocks that are now full and computed (after a step); a
        pressed sequence's never (they hold the tokens its press chose, not a prefix)."""
        full = min(seq.num_computed // self.block_size, len(seq.block_ids))
        caching = self.cache.is_prefix_caching and seq.press is None
        if not caching or full <= seq.num_cached_blocks:
            return
        hashes, tokens, start = self.block_hashes(seq), seq.token_ids(), seq.num_cached_blocks
        for g, table in zip(self.groups, seq.block_tables, strict=True):
            self.cache.cache_blocks(table, hashes, tokens, start, full, g.group_id)
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

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq.num_slots` (a rejected draft's, a press's): none of them
        was cached, so nothing reaches the prefix cache, the tiers or the KV events."""
        keep = -(-seq.num_slots // self.block_size)
        for g, table in zip(self.groups, seq.block_tables, strict=True):
            self.pools[g.pool_id].free(held_blocks(table[keep:]))
            del table[keep:]

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """A draft for a decoding sequence, when the proposer has one and the step's budget
        and free blocks take it (else none: it decodes one token)."""
        p = seq.params
        if self.proposer is None or not seq.output_ids:
            return ()
        if self.can_draft is not None and not self.can_draft(seq):
            return ()
        if len(self.running) > self.spec_max_batch:
            return ()
        if seq.spec_skip:
            seq.spec_skip -= 1
            return ()
        k = min(self.proposer.k, budget - 1, p.max_tokens - len(seq.output_ids) - 1)
        if k < 1:
            return ()
        draft = tuple(self.proposer.propose(seq.token_ids(), self.max_model_len, k))
        return draft if draft and self._can_allocate(seq, 1 + len(draft)) else ()

    def _match(self, seq: Sequence) -> MatchResult:
        if not self.cache.is_prefix_caching or seq.press is not None:
            return NO_MATCH  # a press scores the whole context: it is computed, not hit
        return self.cache.match(self.block_hashes(seq), seq.num_tokens)

    def _can_admit(self, hit: MatchResult, n: int) -> bool:
        copy = 1 if hit.num_cached_tokens % self.block_size else 0  # a partly reused block
        total = -(-(hit.num_cached_tokens + n) // self.block_size)

        def need(g: BlockGroup) -> int:  # new blocks, and hit blocks taken off the free queue
            table = hit.table(g.group_id)
            return total - len(table) + copy + self.pools[g.pool_id].num_free_of(held_blocks(table))

        return self._pools_fit(need)

    def _pools_fit(self, need: Callable[[BlockGroup], int]) -> bool:
        """Whether every pool has the free blocks its groups `need`."""
        per_pool = [0] * len(self.pools)
        for g in self.groups:
            per_pool[g.pool_id] += need(g)
        return all(k <= pool.num_free for k, pool in zip(per_pool, self.pools, strict=True))

    def _admit(self, seq: Sequence, hit: MatchResult) -> None:
        for g in self.groups:
            self.pools[g.pool_id].touch(held_blocks(hit.table(g.group_id)))
        seq.block_tables = [list(hit.table(g.group_id)) for g in self.groups]
        seq.num_computed = hit.num_cached_tokens
        seq.num_cached_blocks = len(hit.block_ids)
        if not seq.is_counted:
            self.stats.record_query(seq.params.tag, seq.num_tokens, hit.num_cached_tokens)
            seq.is_counted = True

    def _reserve(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        while not self._can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self._allocate(seq, n)
        return True

    def _can_allocate(self, seq: Sequence, n: int) -> bool:
        return self._pools_fit(lambda g: self._blocks_needed(seq, n, g))

    def _release_window(self, seq: Sequence) -> None:
        """Free the blocks each sliding group's window no longer reaches: the step's first
        query, at `num_computed`, sees keys from num_computed - window + 1 on (`window_slack`
        keys more where a drafter reads them). Released blocks are a prefix of the table, so
        the scan stops at the first released one."""
        for g, table in zip(self.groups, seq.block_tables, strict=True):
            if g.window == 0:
                continue
            first = max(seq.num_computed - g.window + 1 - self.window_slack, 0)
            first //= self.block_size
            i = min(first, len(table)) - 1
            released = []
            while i >= 0 and table[i] != NULL_BLOCK:
                released.append(table[i])
                table[i], i = NULL_BLOCK, i - 1
            self.pools[g.pool_id].free(released)  # the head last: the tail is evicted first

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_tables(seq)
        seq.num_computed, seq.num_cached_blocks, seq.num_pruned = 0, 0, 0
        seq.is_pressed = False  # recomputed, its context is pressed again
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _free_tables(self, seq: Sequence) -> None:
        for g, table in zip(self.groups, seq.block_tables, strict=False):  # none: waiting
            self.pools[g.pool_id].free(held_blocks(table))
        seq.block_tables = []

    def _blocks_needed(self, seq: Sequence, n: int, g: BlockGroup) -> int:
        total = -(-(seq.num_slots + n) // self.block_size)
        return total - len(seq.block_tables[g.group_id]) + self._needs_copy(seq, g)

    def _needs_copy(self, seq: Sequence, g: BlockGroup) -> bool:
        """Whether the next token's block is one the sequence may not write (shared, cached)."""
        i, table = seq.num_slots // self.block_size, seq.block_tables[g.group_id]
        return i < len(table) and not self.pools[g.pool_id].is_writable(table[i])

    def _allocate(self, seq: Sequence, n: int) -> None:
        for g in self.groups:
            if self._needs_copy(seq, g):
                self._copy_on_write(seq, g)
            needed = max(self._blocks_needed(seq, n, g), 0)
            seq.block_tables[g.group_id] += self.pools[g.pool_id].allocate(needed)

    def _copy_on_write(self, seq: Sequence, g: BlockGroup) -> None:
        """Swap the block about to be written for a private copy. The source is released at
        once: even if reused this step, the engine copies before anything writes."""
        i, table, pool = (
            seq.num_slots // self.block_size,
            seq.block_tables[g.group_id],
            self.pools[g.pool_id],
        )
        src = table[i]
        (dst,) = pool.allocate(1)
        self._copies.append(BlockCopy(src, dst, g.pool_id))
        table[i] = dst
        pool.free([src])
        self.stats.num_cow_copies += 1


def press_chunk(seq: Sequence, n: int) -> int:
    """The tokens a pressed sequence computes this step, of `n`: never past its context's end
    (the press acts there), and never leaving fewer than a SnapKV window for the last chunk
    before it (whose queries the press scores with)."""
    p = seq.press
    if p is None or seq.is_pressed:
        return n
    left = p.context_len(len(seq.prompt_ids)) - seq.num_computed
    if left <= n:
        return left
    if p.method == "snapkv" and left - n < p.window:
        return left - p.window
    return n
