"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences go first, oldest first, each taking what it still
needs (1 token when decoding, the rest of its prompt when prefilling, cut to the budget); then
waiting sequences are admitted oldest first while the budget, `max_num_seqs` and free blocks
allow. When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the waiting queue, to be recomputed later.
Pure Python over ids; the one object handed to the runner is `ScheduledBatch`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvabi.cache.block_pool import BlockPool
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
class ScheduledBatch:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int) -> None:
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
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
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.pool.can_allocate(self._blocks_needed(seq, n)) or preempted:
                break  # admit nothing while memory is short: it would only be preempted again
            self.waiting.pop(0)
            self._allocate(seq, n)
            self.add_running(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return ScheduledBatch(tuple(scheduled), tuple(preempted))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []

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
        seq.block_ids, seq.num_computed = [], 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return -(-(seq.num_computed + n) // self.block_size) - len(seq.block_ids)

    def _allocate(self, seq: Sequence, n: int) -> None:
        seq.block_ids += self.pool.allocate(max(self._blocks_needed(seq, n), 0))
