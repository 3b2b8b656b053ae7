from kvabi.engine.sampling_params import SamplingParams
from kvabi.engine.scheduler import Scheduler, SchedulerConfig
from kvabi.engine.sequence import SeqStatus, Sequence
from tests.cache.tiny import tiny_cache


def _seq(i, n):
    return Sequence(i, f"r{i}", 0, list(range(n)), SamplingParams(), arrival=i)


def _run(sched, batch):
    for s in batch.seqs:  # what the engine does after a step: count tokens, sample one
        s.seq.num_computed = s.start + s.num_tokens
        if s.samples:
            s.seq.output_ids.append(0)


def test_chunked_prefill_budget_and_exact_block_ids():
    cache = tiny_cache(10, prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), cache)
    a, b = _seq(0, 9), _seq(1, 3)
    sched.add(b)
    sched.add(a)  # older arrival goes first whatever the order of adding
    batch = sched.schedule()
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in batch.seqs] == [(0, 0, 6)]
    assert a.block_ids == [0, 1]
    _run(sched, batch)
    batch = sched.schedule()  # a finishes its prompt (3), b starts (3)
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in batch.seqs] == [(0, 6, 3), (1, 0, 3)]
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3])
    assert all(s.samples for s in batch.seqs)


def test_preemption_takes_the_newest_and_requeues_it_in_arrival_order():
    cache = tiny_cache(3, prefix_caching=False)
    pool = cache.pool
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), cache)
    a, b = _seq(0, 4), _seq(1, 4)
    sched.add(a)
    sched.add(b)
    _run(sched, sched.schedule())  # a: [0], b: [1], each 4 tokens + 1 sampled
    assert (a.block_ids, b.block_ids) == ([0], [1])
    batch = sched.schedule()  # a needs block 2; b needs one more: none left -> b preempted
    assert [s.seq.seq_id for s in batch.seqs] == [0] and batch.preempted == (b,)
    assert a.block_ids == [0, 2] and b.block_ids == [] and b.num_computed == 0
    assert b.status == SeqStatus.WAITING and sched.waiting == [b] and pool.num_free == 1
    _run(sched, batch)
    sched.finish(a, "stop")
    assert pool.num_free == 3
    batch = sched.schedule()  # b recomputes its 5 tokens
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in batch.seqs] == [(1, 0, 5)]


def test_max_num_seqs_caps_admission():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), tiny_cache(20, prefix_caching=False))
    for i in range(3):
        sched.add(_seq(i, 2))
    assert [s.seq.seq_id for s in sched.schedule().seqs] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_token_slice_is_that_slice_of_all_the_token_ids():
    seq = _seq(0, 5)
    seq.output_ids += [70, 80, 90]
    for start in range(9):
        for stop in range(start, 10):
            assert seq.token_slice(start, stop) == seq.token_ids()[start:stop]
