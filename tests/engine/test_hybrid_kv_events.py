"""A hybrid engine's KV events name every block group, and a router following them scores the
instance by what it can reuse: the full group's run, however far the sliding window moved on."""

from kvabi.abi.block_hash import hash_blocks
from kvabi.cache.block_events import BlockEventLog, BlockRemoved, BlockStored
from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.routing.kv_event_codec import decode_batch, encode_batch
from kvabi.routing.prefix_index import PrefixIndex
from tests.engine.test_hybrid_groups import BLOCK, WINDOW, hybrid_loaded
from tests.engine.tiny import run_all

PROMPT = list(range(20, 60))  # 10 blocks
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def run_logged(num_blocks: int) -> tuple[LLMEngine, BlockEventLog]:
    log = BlockEventLog()
    config = EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=8)
    e = LLMEngine(hybrid_loaded(), config, "hybrid", EngineHooks(block_events=log))
    run_all(e, [PROMPT], GREEDY)
    return e, log


def test_events_name_both_groups_and_the_sliding_groups_evictions_are_its_own():
    e, log = run_logged(num_blocks=16)  # 11 full blocks held: the sliding group evicts its own
    hashes = hash_blocks(PROMPT, BLOCK, e.cache.hasher.root(None))
    events = log.drain()
    stored = [x for x in events if isinstance(x, BlockStored)]
    removed = [x for x in events if isinstance(x, BlockRemoved)]
    assert {
        (x.group_idx, x.kv_cache_spec_kind, x.kv_cache_spec_sliding_window) for x in stored
    } == {
        (0, "sliding_window", WINDOW),
        (1, "full_attention", None),
    }
    of = lambda xs, g: [h for x in xs if x.group_idx == g for h in x.block_hashes]  # noqa: E731
    assert of(stored, 1) == of(stored, 0) == hashes  # both groups stored every block, in order
    # the blocks the window left were freed first, so evicted first: blocks 0-5, head first
    assert {x.group_idx for x in removed} == {0} and of(removed, 0) == hashes[:6]
    assert e.cache.match(hashes, len(PROMPT)).num_cached_tokens == len(PROMPT) - 1

    index = PrefixIndex()  # the router's view, through the wire
    index.apply("hybrid", 0, decode_batch(encode_batch(events, 1.0)))
    assert index.match(["hybrid"], {BLOCK: hashes}) == {"hybrid": len(PROMPT)}
    assert index.match(["hybrid"], {BLOCK: hashes[:7]}) == {"hybrid": 0}  # its window is gone
