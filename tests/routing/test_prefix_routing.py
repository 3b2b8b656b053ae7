"""The router's index of who holds which block, and its choice: longest cached prefix, then
fewest requests in flight, then round robin."""

import pytest

from kvabi.cache.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvabi.routing.kv_event_codec import EventBatch
from kvabi.routing.prefix_index import PrefixIndex
from kvabi.routing.prefix_routing import EventSource
from kvabi.routing.router import PEER_HEADER, PrefillTarget, Router, RouterConfig

H = [bytes([i]) * 32 for i in range(6)]
G = [bytes([100 + i]) * 32 for i in range(3)]  # the same tokens hashed in blocks of 8


def batch(*events) -> EventBatch:
    return EventBatch(0.0, tuple(events))


def stored(hashes, bs=4) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(bs * len(hashes))), bs, "CPU")


def test_index_follows_stored_removed_and_cleared():
    index = PrefixIndex()
    index.apply("a", 0, batch(stored(H[:4])))
    index.apply("b", 0, batch(stored(H[:2])))
    index.apply("a", 1, batch(BlockRemoved((H[1],), "CPU")))
    assert index.num_blocks() == {"a": 3, "b": 2}
    # a's run stops at the removed block 1: only block 0 counts for it
    assert index.match(["a", "b", "c"], {4: H[:4]}) == {"a": 4, "b": 8, "c": 0}
    index.apply("b", 1, batch(AllBlocksCleared()))
    assert index.match(["b"], {4: H[:4]}) == {"b": 0}


def grouped(hashes, group, window=None) -> BlockStored:
    kind = "sliding_window" if window else "full_attention"
    return BlockStored(
        tuple(hashes), None, tuple(range(4 * len(hashes))), 4, "CPU", group, kind, window
    )


def test_a_hybrid_instance_scores_the_full_groups_run_with_the_sliding_groups_window():
    index = PrefixIndex()
    # group 0 slides (window 6: a prefix of h blocks needs blocks from (4h - 5) // 4 on),
    # group 1 is full attention; the sliding group's window moved on past blocks 0-2
    index.apply("a", 0, batch(grouped(H[:6], 0, 6), grouped(H[:6], 1)))
    index.apply("a", 1, batch(BlockRemoved(tuple(H[:3]), "CPU", 0)))
    assert index.num_blocks() == {"a": 9}
    assert index.match(["a"], {4: H}) == {"a": 24}  # all six: the full group's run
    index.apply("a", 2, batch(BlockRemoved((H[0],), "CPU", 7)))  # a group never stored
    assert index.match(["a"], {4: H}) == {"a": 24}
    index.apply("a", 3, batch(BlockRemoved((H[5],), "CPU", 0)))  # a hole in the window
    assert index.match(["a"], {4: H}) == {"a": 20}  # 5 blocks: the window needs blocks 3, 4
    index.apply("a", 4, batch(BlockRemoved((H[2],), "CPU", 1)))  # the full group's run: 2
    # and 2 blocks would need blocks 0, 1 of the sliding group, which it gave up
    assert index.match(["a"], {4: H}) == {"a": 0}


def test_events_without_a_group_are_group_0_and_a_sliding_only_model_needs_its_window():
    index = PrefixIndex()
    index.apply("old", 0, batch(stored(H[:3]), grouped(H[:2], 0)))  # one group, twice named
    index.apply("old", 1, batch(BlockRemoved((H[1],), "CPU")))
    assert index.match(["old"], {4: H}) == {"old": 4}
    index.apply("swa", 0, batch(grouped(H[2:5], 0, 6)))  # blocks 0, 1 already out of window
    assert index.match(["swa"], {4: H[:5]}) == {"swa": 20}
    assert index.match(["swa"], {4: H[:5] + [G[0]]}) == {"swa": 20}
    index.apply("swa", 1, batch(AllBlocksCleared()))
    assert index.match(["swa"], {4: H}) == {"swa": 0}


def test_each_instance_is_matched_with_the_hashes_of_its_block_size():
    index = PrefixIndex()
    index.apply("small", 0, batch(stored(H[:2], bs=4)))
    index.apply("large", 0, batch(stored(G[:2], bs=8)))
    assert index.block_sizes() == {4, 8}
    assert index.match(["small", "large"], {4: H[:4], 8: G[:2]}) == {"small": 8, "large": 16}


def test_a_sequence_restart_forgets_and_a_gap_keeps_what_is_known():
    index = PrefixIndex()
    index.apply("a", 0, batch(stored(H[:2])))
    index.apply("a", 5, batch(stored(H[2:3])))  # batches 1-4 lost: kept, logged
    assert index.num_blocks() == {"a": 3}
    index.apply("a", 0, batch(stored(H[4:5])))  # it restarted: its old blocks are gone
    assert index.num_blocks() == {"a": 1}
    index.forget("a")
    assert index.num_blocks() == {}


def router(decode=("d0", "d1", "d2"), prefill=()) -> Router:
    sources = tuple(EventSource(u, f"tcp://127.0.0.1:{5000 + i}") for i, u in enumerate(decode))
    return Router(RouterConfig(tuple(prefill), tuple(decode), kv_events=sources))


def test_longest_prefix_first_then_least_loaded_then_round_robin():
    r = router()
    assert [u for u, _ in r.candidates({})] == ["d0", "d1", "d2"]  # turn 0
    assert [u for u, _ in r.candidates({})] == ["d1", "d2", "d0"]  # turn 1
    assert [u for u, _ in r.candidates({"d2": 16, "d0": 8})] == ["d2", "d0", "d1"]
    r.routing.in_flight["d0"] = 2
    r.routing.in_flight["d1"] = 1
    assert [u for u, _ in r.candidates({})] == ["d2", "d1", "d0"]  # turn 3: d0 first by turn
    assert [u for u, _ in r.candidates({"d0": 4})] == ["d0", "d2", "d1"]  # a hit beats load


def test_the_prefill_peer_is_the_prefill_instance_with_the_longest_prefix():
    prefill = (PrefillTarget("p0", "127.0.0.1:1"), PrefillTarget("p1", "127.0.0.1:2"))
    r = router(decode=("d0",), prefill=prefill)
    got = r.candidates({"p1": 32})
    assert got == [("d0", {PEER_HEADER: "127.0.0.1:2"}), ("p1", {}), ("p0", {})]


def test_events_of_an_unknown_instance_are_refused():
    with pytest.raises(ValueError, match="kv_events"):
        RouterConfig((), ("d0",), kv_events=(EventSource("d9", "tcp://127.0.0.1:1"),))
