"""kvabi as vLLM's KV connector (kvabi/connectors/vllm_connector.py): real vLLM processes, one store
shared with kvabi's engine.

vLLM's own prefix cache is off in each vLLM process, so every cached token it reports came from
kvabi's tiers. The store holds kvabi's engine layout (16-token blocks): one vLLM block (128
tokens) is 8 entries. A (disk + Redis) computes the counting prompt P and saves its blocks; P2
shares P's first three vLLM blocks. B is a restart on the same disk folder (and a Redis that is
down), one of whose entries was corrupted in between. kvabi's engine then writes prompt Q to a
disk folder of its own, and an entry of another model is planted in Redis under one of P's
block hashes. C shares only the Redis server with A, and kvabi's folder. Greedy tokens must
equal those computed without any load (baselines run under a cache_salt no other request
uses, so they can neither load nor be loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.tier_config import TierConfig
from kvabi.connectors.vllm_handoff import DISK_BYTES, Handoff, prepare, run_connector_worker
from kvabi.engine.sampling_params import SamplingParams
from kvabi.wire import container_bytes
from tests.cache.redis_server import RedisServer
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = VLLM_MARKS
BS = 128  # vLLM's
STORE_BS = 16  # the store's (kvabi's engine)
RATIO = BS // STORE_BS
DEAD_REDIS = "redis://127.0.0.1:1"


@dataclass
class Runs:
    h: Handoff
    p: list[int]
    q: list[int]
    a: list[dict]  # P2 (salted baseline), P, P2
    b: list[dict]  # P, P2 after a restart with one disk entry corrupted, Redis down
    c: list[dict]  # P from Redis (one entry foreign), Q salted, Q from kvabi's engine
    kvabi_q: list[int]  # kvabi's engine's own tokens on Q
    disk: Path  # A's folder (vLLM's entries)
    b_log: str  # B's stderr
    a_transfer: dict  # A's connector stats
    c_transfer: dict  # C's (its prompts all in flight at once)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out: Path = tmp_path_factory.mktemp("vllm-connector")
    h = prepare(out, "bf16")
    p = h.prompt_ids
    p2 = p[: 3 * BS] + [28, 216, 33] * 5  # shares P's three full blocks, then differs
    q = h.loaded.tokenizer.encode(", ".join(str(i) for i in range(300, 400)) + ",")
    server = RedisServer(out)
    if server.binary is None:
        pytest.skip("redis-server is not installed")
    server.start()
    try:
        disk, kvabi_disk = out / "disk", out / "kvabi-disk"
        a = run_connector_worker(
            h,
            "bf16",
            [{"ids": p2, "cache_salt": "baseline"}, {"ids": p}, {"ids": p2}],
            "a",
            disk_dir=str(disk),
            redis_url=server.url,
        )
        _corrupt(disk / _entry_name(h, p, 2 * RATIO + 3))
        prompts_b = [{"ids": p}, {"ids": p2}]
        b = run_connector_worker(
            h, "bf16", prompts_b, "b", disk_dir=str(disk), redis_url=DEAD_REDIS
        )
        kvabi_q = _kvabi_writes(h, q, kvabi_disk)
        _plant_foreign_entry(h, p, 2 * RATIO + 5, server.url)
        prompts_c = [{"ids": p}, {"ids": q, "cache_salt": "baseline"}, {"ids": q}]
        c = run_connector_worker(
            h, "bf16", prompts_c, "c", disk_dir=str(kvabi_disk), redis_url=server.url,
            together=True, async_load=True,  # layer by layer on the load thread
        )  # fmt: skip
    finally:
        server.stop()
    b_log = (out / "connector-b.log").read_text(encoding="utf-8")
    transfers = a["transfer"], c["transfer"]
    return Runs(h, p, q, a["runs"], b["runs"], c["runs"], kvabi_q, disk, b_log, *transfers)


def _hashes(h: Handoff, ids: list[int]) -> list[bytes]:
    return hash_blocks(ids, STORE_BS, root_hash(h.descriptor().model.compat_digest()))


def _entry_name(h: Handoff, ids: list[int], index: int) -> str:
    """Store block `index`'s entry file, relative to a disk tier's folder."""
    return f"{h.descriptor().model.compat_digest()}/{_hashes(h, ids)[index].hex()}.kvabi"


def _corrupt(path: Path) -> None:
    """Flip one payload byte (the entry's checksum must catch it)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _kvabi_writes(h: Handoff, ids: list[int], folder: Path) -> list[int]:
    """kvabi's engine runs `ids` as a session; its blocks go down to a disk tier at its end."""
    llm = h.engine(tiers=TierConfig(disk_dir=str(folder), disk_bytes=DISK_BYTES))
    params = SamplingParams(max_tokens=h.max_tokens, temperature=0, ignore_eos=True, session="q")
    tokens = list(llm.generate([ids], params)[0].outputs[0].token_ids)
    llm.engine.close()  # every write-down done
    return tokens


def _plant_foreign_entry(h: Handoff, ids: list[int], index: int, redis_url: str) -> None:
    """Store block `index` of `ids`, replaced in Redis by a well-formed entry of another model
    (same hash and tokens): the connector must refuse it."""
    desc = h.descriptor()
    other = replace(desc, model=replace(desc.model, fingerprint="another-model"))
    zeros = CacheBuffers.empty(other, 1, fill="zeros")
    tokens = ids[index * STORE_BS : (index + 1) * STORE_BS]
    block_hash = _hashes(h, ids)[index]
    (redis,) = TierConfig(redis_url=redis_url).build(desc.model.compat_digest())
    redis.remove(block_hash)  # a put keeps an existing entry
    redis.put(block_hash, container_bytes(zeros, tokens, [block_hash]))
    assert redis.get_many([block_hash])[0] == container_bytes(zeros, tokens, [block_hash])

    redis.close()


def test_first_instance_saves_then_loads_instead_of_computing(runs: Runs) -> None:
    baseline, p, p2 = runs.a
    assert baseline["num_cached_tokens"] == 0 and p["num_cached_tokens"] == 0
    assert p2["num_cached_tokens"] == 3 * BS  # P's blocks, through the connector
    assert p2["tokens"] == baseline["tokens"]
    # one request at a time: nothing to overlap a fetch with, so it ran in place
    assert runs.a_transfer["num_background_fetches"] == runs.a_transfer["num_not_yet"] == 0
    num_entries = len(list((runs.disk).rglob("*.kvabi")))
    assert num_entries == 2 * 3 * RATIO  # P's three vLLM blocks, and the baseline's three


def test_restart_finds_prefixes_on_disk_and_a_corrupt_entry_is_a_miss(runs: Runs) -> None:
    p, p2 = runs.b  # Redis is down all along: the connector serves from disk alone
    assert p["num_cached_tokens"] == 2 * BS  # block 3 holds the bad entry: recomputed
    assert p["tokens"] == runs.a[1]["tokens"]
    assert p2["num_cached_tokens"] == 3 * BS  # the bad entry was removed; B saved block 3 anew
    assert p2["tokens"] == runs.a[0]["tokens"]
    assert runs.b_log.count("kvabi: redis tier failed") == 1  # warned once, then served
    assert "refused: section" in runs.b_log and "is corrupt" in runs.b_log


def test_second_instance_shares_redis_and_refuses_another_models_entry(runs: Runs) -> None:
    p = runs.c[0]
    assert p["num_cached_tokens"] == 2 * BS  # block 3 holds the foreign entry: recomputed
    assert p["tokens"] == runs.a[1]["tokens"]


def test_vllm_loads_what_kvabi_engine_stored(runs: Runs) -> None:
    baseline, q = runs.c[1:]
    # C's three prompts were in flight together: Q's hit (the last one asked about) was read
    # off vLLM's scheduling loop, vLLM told "not yet" meanwhile (P, asked first, had none
    # beside it: in place; Q salted holds nothing: a miss at once)
    stats = runs.c_transfer
    assert stats["num_background_fetches"] == 1 and stats["num_not_yet"] >= 1
    assert baseline["num_cached_tokens"] == 0
    assert q["num_cached_tokens"] == (len(runs.q) - 1) // BS * BS
    assert q["tokens"] == baseline["tokens"]
    assert q["tokens"] == runs.kvabi_q  # and what kvabi's engine said from its own prefill
    # placed on the load thread, layer group by layer group, while the forward ran
    assert stats["num_loaded"] > 0 and stats["load_s"] > 0


def test_kvabi_engine_loads_what_vllm_stored(runs: Runs) -> None:
    h = runs.h
    own = h.greedy(h.engine())
    llm = h.engine(tiers=TierConfig(disk_dir=str(runs.disk), disk_bytes=DISK_BYTES))
    tokens = h.greedy(llm)
    hits = llm.engine.cache_stats().get("tier_disk_hit_tokens", 0)
    llm.engine.close()
    assert hits == 3 * BS  # P's three vLLM blocks, 24 entries written by vLLM
    assert tokens == own == runs.a[1]["tokens"]
