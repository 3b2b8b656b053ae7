"""Each tier: capacity, its own LRU (exact order), faults. Entries are opaque bytes here, and
blocks of tensors in the host tier's slots."""

import time

import numpy as np
import pytest
import torch

from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache import disk_tier
from kvabi.cache.block_codec import narrow_blocks
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.disk_tier import DiskTier
from kvabi.cache.host_tier import HostTier
from kvabi.cache.redis_tier import RedisTier
from kvabi.native.cpu_kernels import cpu_kernels, kernel_status
from tests.cache.redis_server import redis_server  # noqa: F401 - a fixture

DIGEST_A, DIGEST_B = "a" * 32, "b" * 32
MODEL = ModelSpec((LayerSpec(ATTN, 2, 8, 8),) * 2, "tiny")


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_host_tier_keeps_the_most_recent_entries_within_capacity():
    tier = HostTier(300)
    for i in range(3):
        tier.put(h(i), bytes([i]) * 100)
    assert tier.get_many([h(0), h(9)]) == [bytes([0]) * 100, None]  # 0 is now most recent
    tier.put(h(3), bytes(100))  # over capacity: the least recent (1) goes
    assert tier.lru_order() == [h(2), h(0), h(3)]
    assert tier.contains_many([h(1), h(2)]) == [False, True]
    tier.put(h(4), bytes(301))  # could never fit: ignored
    tier.remove(h(2))
    assert (tier.num_bytes, tier.num_blocks) == (200, 2)
    assert (tier.stats.writes, tier.stats.evictions, tier.stats.write_bytes) == (4, 1, 400)


def test_host_tier_keeps_blocks_in_slots_beside_bytes_within_one_capacity():
    """Blocks go into slab slots (one copy per buffer); `load_blocks` hands out the slots of
    the leading run it holds; bytes entries share the capacity and the LRU."""
    desc = preset_descriptor("vllm-flash-attn", MODEL, block_size=2, dtype="f32")
    blocks = CacheBuffers(desc, {k: torch.randn(t.shape) for k, t in allocate(desc, 4).items()})
    block_bytes = blocks.num_bytes // 4
    tier = HostTier(3 * block_bytes)
    keys = [BlockKey(h(i), (i, i)) for i in range(4)]
    tier.put_blocks(blocks, keys)  # 4 new blocks, 3 slots: as an LRU, 0 came and went
    assert tier.lru_order() == [h(1), h(2), h(3)]
    assert (tier.stats.writes, tier.stats.evictions) == (4, 1)
    assert tier.get_many([h(1)]) == [None]  # kept as tensors: read by load_blocks
    runs = []
    place = lambda cache, slots, run: runs.append(  # noqa: E731
        (cache.tensors["0"][:, slots].clone(), [k.block_hash for k in run])
    )
    assert tier.load_blocks([keys[2], keys[1], keys[0], keys[3]], MODEL, place) == 2
    ((got, hashes),) = runs
    assert hashes == [h(2), h(1)] and torch.equal(got, blocks.tensors["0"][:, [2, 1]])
    tier.put(h(7), bytes(block_bytes // 2))  # bytes: the least recent block (3) goes
    assert tier.lru_order() == [h(2), h(1), h(7)]
    assert tier.num_bytes == 2 * block_bytes + block_bytes // 2
    tier.put_blocks(narrow_blocks(blocks, 0, 1), keys[:1])  # a slot, not bytes: 2 goes too
    assert tier.lru_order() == [h(1), h(7), h(0)]
    runs.clear()
    assert tier.load_blocks([keys[0]], MODEL, place) == 1
    assert torch.equal(runs[0][0], blocks.tensors["0"][:, [0]])
    other = ModelSpec(MODEL.layers, "other")
    assert tier.load_blocks([keys[1]], other, place) == 0  # another model's: refused, removed
    assert tier.stats.corrupt == 1 and tier.contains_many([h(1)]) == [False]
    assert (tier.stats.writes, tier.stats.evictions) == (6, 3)


def test_disk_tier_survives_a_restart_with_its_lru_order(tmp_path):
    tier = DiskTier(tmp_path, 300, DIGEST_A)
    for i in range(3):
        tier.put(h(i), bytes([i]) * 100)
    assert tier.get_many([h(0)]) == [bytes([0]) * 100]  # 0 is now most recent
    again = DiskTier(tmp_path, 300, DIGEST_A)  # a restarted engine: warm start
    assert (again.num_blocks, again.num_bytes) == (3, 300)
    again.put(h(3), bytes(100))  # evicts 1, the least recent before the restart
    assert again.contains_many([h(0), h(1), h(2), h(3)]) == [True, False, True, True]
    assert sorted(p.name[:4] for p in again.dir.iterdir()) == ["0000", "0202", "0303"]
    assert again.stats.evictions == 1


def test_disk_tier_keeps_models_apart_and_clears_interrupted_writes(tmp_path):
    DiskTier(tmp_path, 1000, DIGEST_A).put(h(1), b"model a")
    (tmp_path / DIGEST_A / ".half-written.tmp").write_bytes(b"x")
    (tmp_path / DIGEST_A / "notes.txt").write_bytes(b"x")
    other = DiskTier(tmp_path, 1000, DIGEST_B)
    assert other.contains_many([h(1)]) == [False] and other.get_many([h(1)]) == [None]
    again = DiskTier(tmp_path, 1000, DIGEST_A)
    assert again.get_many([h(1)]) == [b"model a"]
    assert sorted(p.name for p in again.dir.iterdir()) == [f"{h(1).hex()}.kvabi", "notes.txt"]


@pytest.fixture(params=["kernels", "python"])
def file_reads(request, monkeypatch):
    """The disk tier's bulk reads by the kernels (one call, no GIL), or a file at a time."""
    if request.param == "python":
        monkeypatch.setattr(disk_tier, "cpu_kernels", lambda: None)
    elif cpu_kernels() is None:
        pytest.fail(f"the suite needs the kernels: {kernel_status()}")
    return request.param


def test_disk_rows_are_read_in_place_up_to_the_first_other_size_or_miss(tmp_path, file_reads):
    tier = DiskTier(tmp_path, 1000, DIGEST_A)
    for i, size in enumerate([8, 8, 9, 8]):
        tier.put(h(i), bytes([i]) * size)
    rows = np.zeros((4, 8), dtype=np.uint8)
    assert tier.read_rows([h(0), h(1), h(2), h(3)], rows) == 2  # entry 2 is 9 bytes
    assert rows[:2].tolist() == [[0] * 8, [1] * 8] and not rows[2:].any()
    assert tier.read_rows([h(3), h(7), h(0)], rows) == 1  # h(7): a miss
    assert tier.read_rows([h(1)], rows[:0]) == 0  # no room: nothing read


def test_a_disk_entry_deleted_behind_the_tiers_back_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 1000, DIGEST_A)
    tier.put(h(1), b"x")
    tier.path(h(1)).unlink()
    assert tier.get_many([h(1)]) == [None] and tier.contains_many([h(1)]) == [False]


def test_disk_rows_stop_at_a_file_deleted_or_cut_short_behind_the_tiers_back(tmp_path, file_reads):
    tier = DiskTier(tmp_path, 1000, DIGEST_A)
    for i in range(4):
        tier.put(h(i), bytes([i + 1]) * 8)
    tier.path(h(2)).write_bytes(b"short")  # changed under the tier: still indexed at 8 bytes
    rows = np.zeros((4, 8), dtype=np.uint8)
    assert tier.read_rows([h(0), h(1), h(2), h(3)], rows) == 2
    assert rows[:2].tolist() == [[1] * 8, [2] * 8]
    assert tier.contains_many([h(2)]) == [True]  # the entry-by-entry path reads it, says what
    tier.path(h(1)).unlink()
    assert tier.read_rows([h(0), h(1), h(3)], rows) == 1
    assert tier.contains_many([h(0), h(1), h(3)]) == [True, False, True]  # gone: dropped


def test_a_disk_read_refreshes_the_files_lru_time_across_a_restart(tmp_path, file_reads):
    tier = DiskTier(tmp_path, 24, DIGEST_A)
    for i in range(3):
        tier.put(h(i), bytes([i]) * 8)
    assert tier.read_rows([h(0)], np.zeros((1, 8), dtype=np.uint8)) == 1  # 0: most recent
    assert tier.path(h(0)).stat().st_mtime_ns > tier.path(h(2)).stat().st_mtime_ns
    again = DiskTier(tmp_path, 24, DIGEST_A)  # a restart: the order is the files' times
    again.put(h(3), bytes(8))  # evicts 1, the least recent
    assert again.contains_many([h(0), h(1), h(2), h(3)]) == [True, False, True, True]


def test_redis_tier_lru_and_capacity_are_shared_by_every_client(redis_server):  # noqa: F811
    a = RedisTier(redis_server.url, 300, namespace="t")
    b = RedisTier(redis_server.url, 300, namespace="t")
    a.put(h(0), bytes([0]) * 100)
    a.put(h(1), bytes([1]) * 100)
    b.put(h(2), bytes([2]) * 100)
    b.put(h(2), bytes([2]) * 100)  # present: no second write
    assert b.get_many([h(0), h(5)]) == [bytes([0]) * 100, None]  # 0 is now most recent
    a.put(h(3), bytes(100))  # over the shared capacity: 1 goes
    assert b.contains_many([h(0), h(1), h(2), h(3)]) == [True, False, True, True]
    assert (a.num_bytes, a.num_blocks, a.stats.evictions, b.stats.writes) == (300, 3, 1, 1)
    b.remove(h(0))
    c = RedisTier(redis_server.url, 300, namespace="other")  # another namespace: empty
    assert c.contains_many([h(2)]) == [False]
    assert int(a.client.get("t:bytes")) == 200 and a.client.zcard("t:lru") == 2
    reader = RedisTier(redis_server.url, 300, namespace="t")  # sizes seen on a read too
    reader.get_many([h(2)])
    assert (reader.num_bytes, reader.num_blocks) == (200, 2)


def test_redis_tier_fails_soft_while_down_and_reconnects(redis_server):  # noqa: F811
    tier = RedisTier(redis_server.url, 1000, retry_s=0.2)
    tier.put(h(0), b"x")
    redis_server.stop()
    assert tier.contains_many([h(0)]) == [False]  # fails, counts, marks the tier down
    assert tier.get_many([h(0)]) == [None] and tier.is_down
    tier.put(h(1), b"y")  # down: answered at once, nothing raised
    assert tier.stats.failures == 1
    redis_server.start()  # same port, empty: it lost its data
    time.sleep(0.25)
    tier.put(h(1), b"y")
    assert tier.contains_many([h(0), h(1)]) == [False, True] and not tier.is_down
    assert tier.stats.failures == 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_tier_needs_a_capacity(capacity):
    with pytest.raises(ValueError, match="capacity"):
        HostTier(capacity)


class _Broken(HostTier):
    """A host tier whose reads raise what no tier code catches by name."""

    def _get_many(self, block_hashes):
        raise ValueError("invalid literal for int() with base 10: b'12x34'")


def test_any_exception_from_a_tier_is_a_counted_failure_that_marks_it_down():
    tier = _Broken(1 << 20)
    tier.retry_s = 0.2
    tier.put(h(1), b"entry")
    assert tier.get_many([h(1), h(2)]) == [None, None]  # before: the ValueError escaped
    assert (tier.stats.failures, tier.is_down) == (1, True)
    assert tier.contains_many([h(1)]) == [False]  # down: absent at once, nothing asked
    assert tier.stats.failures == 1
    time.sleep(0.25)
    assert not tier.is_down and tier.contains_many([h(1)]) == [True]


def test_an_outage_is_logged_once_however_many_retries_fail(caplog):
    tier = _Broken(1 << 20)
    tier.retry_s = 0.05
    for _ in range(3):  # each after the retry delay: asked again, failed again
        time.sleep(0.06)
        tier.get_many([h(1)])
    assert tier.stats.failures == 3
    assert caplog.text.count("host tier failed") == 1
    time.sleep(0.06)
    tier.put(h(1), b"entry")  # a success ends the outage: the next failure is logged
    tier.get_many([h(1)])
    assert caplog.text.count("host tier failed") == 2


def test_a_redis_value_this_code_did_not_write_is_a_tier_failure(redis_server):  # noqa: F811
    tier = RedisTier(redis_server.url, 1 << 20, retry_s=0.2)
    tier.put(h(1), b"entry")
    tier.client.set("kvabi:bytes", b"12x34")
    assert tier.get_many([h(1)]) == [None]
    assert tier.stats.failures == 1 and tier.is_down
    tier.client.set("kvabi:bytes", b"5")  # repaired: used again once the tier is back up
    time.sleep(0.25)
    assert tier.get_many([h(1)]) == [b"entry"]
    tier.close()
