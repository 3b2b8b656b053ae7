"""The engine over real tiers: host RAM, disk files, a real redis-server shared by processes."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from kvabi.wire import container_size
from tests.cache.redis_server import free_port, redis_server  # noqa: F401 - a fixture
from tests.engine.tiny import greedy_reference, run_all, tiny_engine, tiny_loaded

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SESSION = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, session="s")
P = list(range(10, 31))  # 21 tokens: 5 full blocks of 4; + 5 computed outputs: 6 cached
Q = list(range(100, 130))


def tokens(engine, prompt, params=GREEDY):
    return run_all(engine, [prompt], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference():
    """Each prompt's greedy tokens computed alone, clear of near-ties (see tiny.py): a prompt
    partly loaded from a tier computes only its tail, in GEMMs of other row counts."""
    return {tuple(p): greedy_reference(p, GREEDY.max_tokens) for p in (P, Q)}


def tier_config(kind, tmp_path, request, **kw):
    if kind == "host":
        return TierConfig(host_bytes=1 << 20, **kw)
    if kind == "disk":
        return TierConfig(disk_dir=str(tmp_path / "kv"), **kw)
    return TierConfig(redis_url=request.getfixturevalue("redis_server").url, **kw)


@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
def test_blocks_evicted_to_a_tier_come_back_with_identical_outputs(
    kind, tmp_path, request, reference
):
    engine = tiny_engine(block_size=4, num_blocks=12, tiers=tier_config(kind, tmp_path, request))
    assert tokens(engine, P) == reference[tuple(P)]
    assert tokens(engine, Q) == reference[tuple(Q)]  # 9 blocks: evicts P's last 3 (tail first)
    engine.flush_tiers()
    stats = engine.cache_stats()
    assert (stats["tier_pool_evictions"], stats[f"tier_{kind}_writes"]) == (3, 3)
    before = stats["prefix_hit_tokens"]
    assert tokens(engine, P) == reference[tuple(P)]
    stats = engine.cache_stats()
    assert stats["prefix_hit_tokens"] - before == 20  # 5 full blocks: 3 pooled, 2 loaded
    assert stats[f"tier_{kind}_hit_tokens"] == 8 and stats[f"tier_{kind}_loads"] == 1
    engine.close()


def test_a_read_from_disk_runs_off_the_step_while_others_decode(tmp_path, reference):
    """A request whose prefix is on disk waits for its read on the loader's thread; the steps
    go on decoding another request meanwhile; once read, its blocks are placed and it runs
    with its prefix loaded, its tokens the reference's."""
    engine = tiny_engine(block_size=4, num_blocks=12, tiers=TierConfig(disk_dir=str(tmp_path)))
    tokens(engine, P)
    tokens(engine, Q)  # P's last 3 blocks go to disk
    engine.flush_tiers()
    disk, gate = engine.cache.tiers.tier("disk"), threading.Event()
    read, read_rows = disk._get_many, disk._read_rows  # a slow disk, either way it is read
    disk._get_many = lambda hashes: (gate.wait(30), read(hashes))[1]
    disk._read_rows = lambda hashes, rows, sums: (gate.wait(30), read_rows(hashes, rows, sums))[1]
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    other = engine.add_request(list(range(200, 206)), long)
    acc, done = OutputAccumulator(), {}

    def step() -> list[str]:
        deltas = engine.step()
        done.update((o.request_id, o) for o in acc.add(deltas))
        return [d.request_id for d in deltas]

    step()  # the other request's prefill
    rid = engine.add_request(P, GREEDY)
    assert [step() for _ in range(5)] == [[other]] * 5  # it decodes while P's read waits
    (seq,) = engine.requests[rid]
    assert seq.is_loading and seq.num_computed == 0
    gate.set()
    while engine.has_unfinished():
        step()
    assert done[rid].outputs[0].token_ids == reference[tuple(P)]
    stats = engine.cache_stats()
    assert stats["tier_disk_hit_tokens"] == 8 and stats["tier_disk_loads"] == 1
    engine.close()


def test_one_load_can_span_tiers_each_searched_in_order(tmp_path, reference):
    entry = container_size(tiny_engine(block_size=4).info.descriptor, 4, 1)
    config = TierConfig(host_bytes=entry, disk_dir=str(tmp_path))  # host RAM holds one entry
    engine = tiny_engine(block_size=4, num_blocks=12, tiers=config)
    tokens(engine, P)
    tokens(engine, Q)  # evicts P's blocks 5, 4, 3: all on disk, only the last (3) in host RAM
    engine.flush_tiers()
    stats = engine.cache_stats()
    assert (stats["tier_host_blocks"], stats["tier_host_evictions"]) == (1, 2)
    assert (stats["tier_disk_blocks"], stats["tier_disk_writes"]) == (3, 3)
    assert tokens(engine, P) == reference[tuple(P)]  # blocks 0-2 pooled, 3 host, 4 disk
    stats = engine.cache_stats()
    assert (stats["tier_host_hit_tokens"], stats["tier_disk_hit_tokens"]) == (4, 4)
    # asked (in tokens) on each lookup, P, Q, P: host every block past the pool, disk only
    # what host RAM lacked, up to the first block no tier has
    assert (stats["tier_host_query_tokens"], stats["tier_disk_query_tokens"]) == (16, 12)
    engine.close()


def test_the_disk_tier_warm_starts_and_refuses_another_models_files(tmp_path, reference):
    config = TierConfig(disk_dir=str(tmp_path))
    first = tiny_engine(block_size=4, tiers=config)
    assert tokens(first, P, SESSION) == reference[tuple(P)]  # idle session: written down
    first.close()
    ours = first.cache.tiers.tier("disk").dir
    files = sorted(p.name for p in ours.iterdir())
    assert len(files) == 6
    restarted = tiny_engine(block_size=4, tiers=config)
    assert tokens(restarted, P) == reference[tuple(P)]
    assert restarted.cache_stats()["tier_disk_hit_tokens"] == 20

    def other_model() -> LLMEngine:
        return LLMEngine(tiny_loaded(seed=1), EngineConfig(block_size=4, tiers=config), "tiny-1")

    other = other_model()
    want = tokens(other, P)
    assert other.cache_stats()["tier_disk_hit_tokens"] == 0  # its own folder: nothing there
    planted = other.cache.tiers.tier("disk").path(_first_hash(other, P))
    planted.write_bytes((ours / files[0]).read_bytes())  # model tiny's entry, under its name
    again = other_model()  # warm start lists the planted file
    assert tokens(again, P) == want
    stats = again.cache_stats()
    assert (stats["tier_disk_refused"], stats["tier_disk_hit_tokens"]) == (1, 0)
    assert not planted.exists() and sorted(p.name for p in ours.iterdir()) == files


def _first_hash(engine, prompt):
    return engine.cache.hasher.hashes(prompt)[0]


def test_a_corrupt_disk_entry_is_a_miss_and_is_removed(tmp_path, reference):
    engine = tiny_engine(block_size=4, tiers=TierConfig(disk_dir=str(tmp_path)))
    tokens(engine, P, SESSION)
    engine.flush_tiers()
    engine.reset_prefix_cache()
    disk = engine.cache.tiers.tier("disk")
    hashes = engine.cache.hasher.hashes(P)
    broken = disk.path(hashes[2])
    broken.write_bytes(broken.read_bytes()[:-500])  # truncated
    assert tokens(engine, P) == reference[tuple(P)]
    stats = engine.cache_stats()
    assert (stats["tier_disk_corrupt"], stats["tier_disk_hit_tokens"]) == (1, 8)
    assert not broken.exists() and disk.contains_many([hashes[2]]) == [False]


def test_redis_going_away_mid_run_fails_no_request_and_it_reconnects(
    redis_server,  # noqa: F811
    reference,
):
    config = TierConfig(redis_url=redis_server.url, redis_retry_s=0.2)
    engine = tiny_engine(block_size=4, tiers=config)
    assert tokens(engine, P, SESSION) == reference[tuple(P)]
    engine.flush_tiers()
    redis_server.stop()
    engine.reset_prefix_cache()
    assert tokens(engine, P, SESSION) == reference[tuple(P)]  # served, recomputed
    engine.flush_tiers()
    stats = engine.cache_stats()
    assert stats["tier_redis_failures"] >= 1 and stats["tier_redis_hit_tokens"] == 0
    redis_server.start()  # back, empty
    time.sleep(0.25)
    assert tokens(engine, Q, SESSION) == reference[tuple(Q)]
    engine.flush_tiers()
    engine.reset_prefix_cache()
    assert tokens(engine, Q) == reference[tuple(Q)]
    stats = engine.cache_stats()
    assert stats["tier_redis_hit_tokens"] == 28 and stats["tier_redis_up"] == 1
    engine.close()


def test_an_engine_starts_and_serves_with_redis_unreachable(reference):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    engine = tiny_engine(block_size=4, tiers=TierConfig(redis_url=url, redis_retry_s=60))
    assert tokens(engine, P, SESSION) == reference[tuple(P)]
    engine.flush_tiers()
    assert tokens(engine, Q) == reference[tuple(Q)]
    stats = engine.cache_stats()
    assert (stats["tier_redis_failures"], stats["tier_redis_up"]) == (1, 0)  # then down: no waits
    engine.close()


SECOND_PROCESS = """
import json, sys
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.sampling_params import SamplingParams
from kvabi.wire import container_size
from tests.engine.tiny import run_all, tiny_engine
engine = tiny_engine(block_size=4, kv_layout="hnd", tiers=TierConfig(redis_url=sys.argv[1]))
params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
out = run_all(engine, [list(range(10, 31))], params)[0].outputs[0].token_ids
print(json.dumps({"tokens": out, "stats": engine.cache_stats()}))
"""


def test_a_second_process_in_another_layout_reuses_what_the_first_computed(
    redis_server,  # noqa: F811
    reference,
):
    first = tiny_engine(block_size=4, tiers=TierConfig(redis_url=redis_server.url))  # NHD
    assert tokens(first, P, SESSION) == reference[tuple(P)]
    first.close()  # flushes the write-down
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", SECOND_PROCESS, redis_server.url],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    second = json.loads(result.stdout.splitlines()[-1])
    assert tuple(second["tokens"]) == reference[tuple(P)]
    assert second["stats"]["tier_redis_hit_tokens"] == 20


def test_a_bad_value_in_redis_costs_no_request_and_no_block(redis_server, reference):  # noqa: F811
    # Before: the tier's ValueError escaped the load, the blocks it had pinned stayed taken and
    # every later request waited forever on a pool with 0 free blocks.
    config = TierConfig(redis_url=redis_server.url, redis_retry_s=0.2)
    engine = tiny_engine(block_size=4, num_blocks=12, tiers=config)
    assert tokens(engine, P) == reference[tuple(P)]
    assert tokens(engine, Q) == reference[tuple(Q)]  # evicts P's tail to Redis
    engine.flush_tiers()
    client = engine.cache.tiers.tier("redis").client
    client.set("kvabi:bytes", b"12x34")
    for _ in range(3):
        assert tokens(engine, P) == reference[tuple(P)]
        assert tokens(engine, Q) == reference[tuple(Q)]
        assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert engine.cache_stats()["tier_redis_failures"] >= 1
    client.set("kvabi:bytes", str(sum(len(client.get(k)) for k in client.keys("kvabi:block:*"))))
    time.sleep(0.25)  # back up: the tier serves again
    before = engine.cache_stats()["tier_redis_hit_tokens"]
    assert tokens(engine, P) == reference[tuple(P)]  # its tail, evicted by Q, from Redis
    assert engine.cache_stats()["tier_redis_hit_tokens"] - before == 8  # as in the first test
    engine.close()
