"""Block entries (encode, verify, convert), the write-down thread and loading back into a pool."""

import threading

import pytest
import torch

from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_codec import BlockCodec
from kvabi.cache.block_hasher import BlockKey
from kvabi.cache.disk_tier import DiskTier
from kvabi.cache.host_tier import HostTier
from kvabi.cache.kv_cache import KVCache
from kvabi.cache.kv_storage import KVStorage
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_writer import TierWriter
from kvabi.wire import ChecksumError, FormatError, TruncatedError
from kvabi.wire.entries import entry_shape

MODEL = ModelSpec((LayerSpec(ATTN, 2, 8, 8),) * 2, "tiny")
DESC = preset_descriptor("vllm-flash-attn", MODEL, block_size=4, dtype="f32")
TOKENS = list(range(50, 62))  # 3 full blocks


def fill(storage: KVStorage, seed: int) -> KVStorage:
    gen = torch.Generator().manual_seed(seed)
    for t in storage.buffers.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return storage


def filled_storage(desc=DESC, num_blocks=6, seed=0) -> KVStorage:
    return fill(KVStorage(desc, num_blocks), seed)


def same_block(a: KVStorage, a_id: int, b: KVStorage, b_id: int) -> bool:
    return all(
        torch.equal(a.k[i][a_id].float(), b.k[i][b_id].float())
        and torch.equal(a.v[i][a_id].float(), b.v[i][b_id].float())
        for i in range(len(a.k))
    )


def test_an_entry_round_trips_and_loads_into_another_layout():
    src = filled_storage()
    key = BlockKey(b"\x01" * 32, (1, 2, 3, 4))
    codec = BlockCodec(DESC)
    entry = codec.encode(src.read_blocks([4, 2]), 1, key)  # block 2
    hnd = preset_descriptor("vllm-flash-attn-hnd", MODEL, block_size=4, dtype="f32")
    dst = KVStorage(hnd, 3)
    dst.write_blocks(BlockCodec(hnd).decode(entry, key), [1])
    assert same_block(src, 2, dst, 1) and not same_block(src, 4, dst, 1)


def flip(entry: bytes, at: int) -> bytes:
    return entry[:at] + bytes([entry[at] ^ 1]) + entry[at + 1 :]


@pytest.mark.parametrize(
    "damage, error",
    [
        (lambda e, k: (e, BlockKey(b"\x02" * 32, k.token_ids)), FormatError),
        (lambda e, k: (e, BlockKey(k.block_hash, (1, 2, 3, 5))), FormatError),
        (lambda e, k: (e[:-100], k), TruncatedError),
        (lambda e, k: (flip(e, len(e) // 2), k), ChecksumError),  # a payload byte
    ],
)
def test_an_entry_that_is_not_exactly_the_block_asked_for_is_refused(damage, error):
    key = BlockKey(b"\x01" * 32, (1, 2, 3, 4))
    entry = BlockCodec(DESC).encode(filled_storage().read_blocks([0]), 0, key)
    entry, key = damage(entry, key)
    with pytest.raises(error):
        BlockCodec(DESC).decode(entry, key)


def test_an_entry_of_another_model_is_refused():
    key = BlockKey(b"\x01" * 32, (1, 2, 3, 4))
    entry = BlockCodec(DESC).encode(filled_storage().read_blocks([0]), 0, key)
    other = preset_descriptor("vllm-flash-attn", ModelSpec(MODEL.layers, "other"), block_size=4)
    with pytest.raises(IncompatibleError, match="fingerprint"):
        BlockCodec(other).decode(entry, key)


class GatedTier(HostTier):
    """A host tier whose writes wait for a gate: the writer thread stalls, the queue fills."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()

    def put_blocks(self, blocks, keys) -> None:
        self.gate.wait(10)
        super().put_blocks(blocks, keys)


def test_the_writer_never_blocks_and_drops_what_its_queue_cannot_hold():
    tier = GatedTier()
    storage = filled_storage()
    keys = [BlockKey(bytes([i]) * 32, (i, i, i, i)) for i in range(4)]
    writer = TierWriter([tier], BlockCodec(DESC), max_queued_bytes=250)
    assert writer.reserve(2, 100) == 2  # room for 2 blocks of 100 bytes
    writer.submit(storage.read_blocks([0, 1]), keys[:2], 200)
    assert writer.reserve(2, 100) == 0  # full: dropped at once, nothing copied
    assert (writer.num_queued_bytes, writer.num_dropped_blocks) == (200, 2)
    tier.gate.set()
    writer.flush()
    assert tier.lru_order() == [keys[0].block_hash, keys[1].block_hash]
    assert writer.reserve(3, 100) == 2  # the leading two fit
    writer.submit(storage.read_blocks([0, 3]), [keys[0], keys[3]], 200)
    writer.close()
    assert (tier.stats.writes, writer.num_queued_bytes, writer.num_dropped_blocks) == (3, 0, 3)
    # 0 was held: not copied again, made most recent (it was just in use in the pool)
    assert tier.lru_order() == [k.block_hash for k in (keys[1], keys[0], keys[3])]


def test_encoded_entries_go_to_the_tiers_lacking_them_and_are_queued_till_then(tmp_path):
    disk, host = DiskTier(tmp_path, 1 << 20, "d" * 32), HostTier(1 << 20)
    codec = BlockCodec(DESC)
    keys = [BlockKey(bytes([i]) * 32, (i, i, i, i)) for i in range(3)]
    entries = codec.encode_many(filled_storage().read_blocks([0, 1, 2]), keys)
    host.put(keys[1].block_hash, entries[1])
    gate, put = threading.Event(), host.put
    host.put = lambda h, e: (gate.wait(10), put(h, e))  # the writer stalls on the first tier
    writer, size = TierWriter([host, disk], codec, max_queued_bytes=1 << 20), len(entries[0])
    assert writer.reserve(3, size) == 3
    writer.submit_entries([(k.block_hash, e) for k, e in zip(keys, entries, strict=True)], 3 * size)
    assert writer.is_queued([keys[2].block_hash]) and not writer.is_queued([b"\x09" * 32])
    gate.set()
    writer.close()
    assert not writer.is_queued([k.block_hash for k in keys])
    assert disk.contains_many([k.block_hash for k in keys]) == [True] * 3
    assert (host.stats.writes, disk.stats.writes, writer.num_queued_bytes) == (3, 3, 0)
    assert disk.get_many([keys[2].block_hash]) == [bytes(entries[2])]


def tiered(num_blocks=6) -> KVCache:
    cache = KVCache(DESC, num_blocks, tiers=TierConfig(host_bytes=1 << 20))
    fill(cache.storage, seed=1)
    return cache


def write_chain(cache: KVCache, keys: list[BlockKey]) -> list[int]:
    """Blocks 0, 1, 2 hold the chain: computed, indexed, freed, then written down."""
    ids = cache.pool.allocate(3)
    for block_id, key in zip(ids, keys, strict=True):
        cache.pool.cache_block(block_id, key)
    cache.pool.free(ids)
    cache.demote([k.block_hash for k in keys])
    cache.flush()
    return ids


def test_held_loads_the_run_after_the_pooled_prefix_into_exact_blocks():
    cache = tiered()
    keys = cache.hasher.keys(TOKENS)
    reference = filled_storage(num_blocks=6, seed=1)  # what blocks 0..2 held
    write_chain(cache, keys)
    assert cache.pool.allocate(6) == [3, 4, 5, 2, 1, 0]  # demoted: the chain's tail first
    assert cache.pool.num_evictions == 3
    for t in cache.storage.buffers.tensors.values():
        t.zero_()  # their memory was reused and overwritten
    for block_ids in ([5], [1], [3], [0, 2, 4]):
        cache.pool.free(block_ids)  # empty queue: 5, 1, 3, 4, 2, 0
    assert cache.held(keys) == 3
    assert [cache.pool.cached_block(k.block_hash) for k in keys] == [5, 1, 3]
    assert all(same_block(reference, i, cache.storage, b) for i, b in enumerate([5, 1, 3]))
    host = cache.tiers.tier("host")
    assert cache.pool.num_free == 6 and host.stats.hit_tokens == 12
    assert cache.held(keys) == 3 and host.stats.hit_tokens == 12  # all pooled: nothing loaded


def on_disk(tmp_path) -> tuple[KVCache, list[BlockKey], DiskTier]:
    """A cache whose chain of TOKENS' blocks is on disk only (none pooled)."""
    cache = KVCache(DESC, 6, tiers=TierConfig(disk_dir=str(tmp_path)))
    fill(cache.storage, seed=1)
    keys = cache.hasher.keys(TOKENS)
    write_chain(cache, keys)
    cache.pool.drop_cached()
    return cache, keys, cache.tiers.tier("disk")


def test_a_corrupt_entry_is_a_miss_removed_and_the_load_stops_before_it(tmp_path):
    cache, keys, disk = on_disk(tmp_path)
    good = disk.get_many([keys[1].block_hash])[0]
    disk.remove(keys[1].block_hash)
    disk.put(keys[1].block_hash, good[:-64] + bytes(64))  # a damaged copy of block 1
    assert cache.held(keys) == 1  # block 0 only: the chain breaks at block 1
    assert disk.contains_many([k.block_hash for k in keys]) == [True, False, True]
    assert (disk.stats.corrupt, disk.stats.hit_tokens) == (1, 4)
    assert cache.num_pooled([k.block_hash for k in keys]) == 1


@pytest.mark.parametrize("kernels", [True, False])
def test_a_payload_byte_flipped_on_disk_is_caught_by_its_checksum(tmp_path, kernels, monkeypatch):
    # only the section checksum can see it: the sums the disk tier takes while it reads the
    # file (the kernels), or those the verifier takes itself (no kernels)
    if not kernels:
        monkeypatch.setattr("kvabi.cache.disk_tier.cpu_kernels", lambda: None)
        monkeypatch.setattr("kvabi.wire.entries.cpu_kernels", lambda: None)
    cache, keys, disk = on_disk(tmp_path)
    shape = entry_shape(DESC)
    path = disk.path(keys[2].block_hash)
    at = shape.sections[0].payload_at + 3
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    assert cache.held(keys) == 2  # blocks 0 and 1: the chain breaks at block 2
    assert disk.contains_many([k.block_hash for k in keys]) == [True, True, False]
    assert disk.stats.corrupt == 1


def test_a_host_block_held_under_other_tokens_is_refused_and_removed():
    cache = tiered()
    keys = cache.hasher.keys(TOKENS)
    write_chain(cache, keys)
    cache.pool.drop_cached()
    host = cache.tiers.tier("host")
    host.remove(keys[1].block_hash)
    stray = BlockKey(keys[1].block_hash, (9, 9, 9, 9))  # the hash, with other tokens
    host.put_blocks(cache.storage.read_blocks([0]), [stray])
    assert cache.held(keys) == 1
    assert host.contains_many([k.block_hash for k in keys]) == [True, False, True]
    assert (host.stats.corrupt, host.stats.hit_tokens) == (1, 4)


def test_one_load_takes_a_run_from_each_tier_into_exact_blocks(tmp_path):
    """Blocks 0-1 from host RAM (gathered out of its slab), block 2 from disk (decoded): all
    three land in the pool, the first run's blocks held while the second is placed."""
    cache = KVCache(DESC, 6, tiers=TierConfig(host_bytes=1 << 20, disk_dir=str(tmp_path)))
    fill(cache.storage, seed=1)
    reference = filled_storage(num_blocks=6, seed=1)
    keys = cache.hasher.keys(TOKENS)
    ids = write_chain(cache, keys)
    cache.pool.drop_cached()
    for t in cache.storage.buffers.tensors.values():
        t.zero_()
    host, disk = cache.tiers.tier("host"), cache.tiers.tier("disk")
    host.remove(keys[2].block_hash)
    assert cache.held(keys) == 3
    placed = [cache.pool.cached_block(k.block_hash) for k in keys]
    assert len(set(placed)) == 3 and None not in placed
    assert all(same_block(reference, i, cache.storage, b) for i, b in zip(ids, placed, strict=True))
    assert (host.stats.hit_tokens, disk.stats.hit_tokens) == (8, 4)
    assert cache.pool.num_free == 6  # nothing left referenced


def test_an_import_that_evicts_a_cached_block_writes_it_down_first():
    """The write-down happens inside allocation: an import (or any allocation) that takes a
    cached block's memory hands its data to the tiers before anything overwrites it."""
    cache = tiered(num_blocks=3)
    keys = cache.hasher.keys(TOKENS)
    reference = filled_storage(num_blocks=3, seed=1)
    ids = cache.pool.allocate(3)
    cache.cache_blocks(ids, [k.block_hash for k in keys], TOKENS, 0, 3)
    cache.pool.free(ids)  # cached, in no tier yet
    other = list(range(200, 212))
    payload = KVCache(DESC, 3).export(other, None)  # nothing pooled there: empty
    assert payload.cache.extent == 0
    source = KVCache(DESC, 3)
    fill(source.storage, seed=7)
    src_ids = source.pool.allocate(3)
    source.cache_blocks(src_ids, source.hasher.hashes(other), other, 0, 3)
    payload = source.export(other, None)
    assert cache.import_blocks(other, None, payload).num_placed_blocks == 3
    cache.flush()
    host = cache.tiers.tier("host")
    assert host.contains_many([k.block_hash for k in keys]) == [True] * 3
    back = tiered(num_blocks=3)
    back.tiers = cache.tiers  # read the same host tier into a fresh pool
    for t in back.storage.buffers.tensors.values():
        t.zero_()
    assert back.held(keys) == 3
    blocks = [back.pool.cached_block(k.block_hash) for k in keys]
    assert all(same_block(reference, i, back.storage, b) for i, b in enumerate(blocks))


def test_entries_converted_straight_out_of_another_layout_are_the_encoders_bytes():
    """`encode_from` (the vLLM connector's save): vLLM's CPU blocks of 8 tokens, through their
    block ids, converted into the entries themselves: the bytes of converting, then encoding."""
    from kvabi.abi.buffers import CacheBuffers
    from kvabi.abi.convert import convert

    vec = preset_descriptor("vllm-cpu-vec", MODEL, block_size=8, dtype="f32")
    gen = torch.Generator().manual_seed(5)
    src = CacheBuffers.empty(vec, 4)
    for t in src.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    keys = [BlockKey(bytes([i + 1]) * 32, tuple(range(4 * i, 4 * i + 4))) for i in range(4)]
    codec = BlockCodec(DESC)
    entries, num_bytes = codec.encode_from(src, [3, 1], keys)
    blocks = convert(src, DESC, num_tokens=16, src_block_ids=[3, 1])
    assert entries == [codec.encode(blocks, i, k) for i, k in enumerate(keys)]
    assert num_bytes == blocks.num_bytes
