"""kvabi as vLLM's KV connector (kvabi/bench/vllm_connector.py): three real vLLM processes.

vLLM's own prefix cache is off in each, so every cached token it reports came from kvabi's
tiers. A (disk + Redis) computes the counting prompt P and saves its blocks; P2 shares P's
first three blocks. B is a restart on the same disk folder, one of whose entries was
corrupted in between; C is another instance that shares only the Redis server. Greedy tokens
must equal those computed without any load (P2's baseline runs in A under a cache_salt no
other request uses, so it can neither load nor be loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvabi.bench.vllm_handoff import prepare, run_connector_worker
from tests.cache.redis_server import RedisServer
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = VLLM_MARKS
BS = 128


@dataclass
class Runs:
    p: list[int]
    a: list[dict]  # P2 (salted baseline), P, P2
    b: list[dict]  # P, P2 after a restart with one disk entry corrupted
    c: list[dict]  # P, from Redis only


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out: Path = tmp_path_factory.mktemp("vllm-connector")
    h = prepare(out, "bf16")
    p = h.prompt_ids
    p2 = p[: 3 * BS] + [28, 216, 33] * 5  # shares P's three full blocks, then differs
    server = RedisServer(out)
    if server.binary is None:
        pytest.skip("redis-server is not installed")
    server.start()
    try:
        disk = str(out / "disk")
        a = run_connector_worker(
            h,
            "bf16",
            [{"ids": p2, "cache_salt": "baseline"}, {"ids": p}, {"ids": p2}],
            "a",
            disk_dir=disk,
            redis_url=server.url,
        )
        _corrupt_one_entry(Path(disk), p)
        b = run_connector_worker(h, "bf16", [{"ids": p}, {"ids": p2}], "b", disk_dir=disk)
        c = run_connector_worker(h, "bf16", [{"ids": p}], "c", redis_url=server.url)
    finally:
        server.stop()
    return Runs(p, a["runs"], b["runs"], c["runs"])


def _corrupt_one_entry(disk: Path, prompt: list[int]) -> None:
    """Flip one payload byte of the entry of P's third block (its checksum must catch it)."""
    from kvabi.abi.block_hash import hash_blocks, root_hash

    entries = sorted(disk.rglob("*.kvabi"))
    assert len(entries) == 3 + 3  # P's three blocks, and the salted baseline's three
    digest = entries[0].parent.name
    third = hash_blocks(prompt, BS, root_hash(digest))[2]
    path = entries[0].parent / f"{third.hex()}.kvabi"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_first_instance_saves_then_loads_instead_of_computing(runs: Runs) -> None:
    baseline, p, p2 = runs.a
    assert baseline["num_cached_tokens"] == 0 and p["num_cached_tokens"] == 0
    assert p2["num_cached_tokens"] == 3 * BS  # P's blocks, through the connector
    assert p2["tokens"] == baseline["tokens"]


def test_restart_finds_prefixes_on_disk_and_a_corrupt_entry_is_a_miss(runs: Runs) -> None:
    p, p2 = runs.b
    assert p["num_cached_tokens"] == 2 * BS  # block 3's entry fails its checksum: recomputed
    assert p["tokens"] == runs.a[1]["tokens"]
    assert p2["num_cached_tokens"] == 3 * BS  # the bad entry was removed; B saved block 3 anew
    assert p2["tokens"] == runs.a[0]["tokens"]


def test_second_instance_shares_the_redis_store(runs: Runs) -> None:
    (p,) = runs.c
    assert p["num_cached_tokens"] == 3 * BS
    assert p["tokens"] == runs.a[1]["tokens"]
