"""Fuzz the reader: a mutated container reads back equal or raises a KvabiError, nothing else."""

from __future__ import annotations

import struct
from functools import lru_cache

import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.errors import KvabiError
from kvabi.wire import Container, container_bytes, read_container

DESC = Descriptor(
    ModelSpec(
        (LayerSpec("attn", 1, 8, 8), LayerSpec("shared", shares=0), LayerSpec("attn", 1, 8, 4)),
        fingerprint="fuzz",
    ),
    Layout(axes="BNHC", block_size=2, dtype="bf16", planes="separate"),
)
TOKENS = [3, 1, 4, 1, 5]
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@lru_cache(maxsize=1)
def _valid() -> bytes:
    cache = CacheBuffers.empty(DESC, 3)
    for i, t in enumerate(cache.tensors.values()):
        t.copy_(torch.arange(t.numel()).reshape(t.shape) * (i + 1) / 7)
    hashes = hash_blocks(TOKENS, 2, root_hash(DESC.model.compat_digest()))
    return container_bytes(cache, TOKENS, hashes)


def _same(a: Container, b: Container) -> bool:
    if (a.desc, a.token_ids, a.block_hashes) != (b.desc, b.token_ids, b.block_hashes):
        return False
    raw = {k: t.contiguous().view(torch.uint8) for k, t in a.cache.tensors.items()}
    return raw.keys() == b.cache.tensors.keys() and all(
        torch.equal(raw[k], b.cache.tensors[k].contiguous().view(torch.uint8)) for k in raw
    )


_position = st.integers(min_value=0, max_value=len(_valid()) - 1)
_mutation = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(0, 7)),
    st.tuples(st.just("truncate"), _position, st.just(0)),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=70)),
    st.tuples(st.just("overwrite"), _position, st.binary(min_size=1, max_size=70)),
    st.tuples(st.just("append"), st.just(0), st.binary(min_size=1, max_size=8)),
)


def _mutate(data: bytearray, kind: str, pos: int, arg: int | bytes) -> None:
    pos = min(pos, len(data))
    if kind == "flip" and pos < len(data):
        data[pos] ^= 1 << arg
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = arg
    elif kind == "overwrite":
        data[pos : pos + len(arg)] = arg
    elif kind == "append":
        data += arg


def _reseal(data: bytearray) -> None:
    """Recompute every checksum the (mutated) structure points at, so later checks are reached."""
    if len(data) < 32:
        return
    desc_len, num_tokens, num_hashes, num_sections = struct.unpack_from("<IIII", data, 16)
    pos = 32 + desc_len + 4 * num_tokens + 32 * num_hashes
    if pos + 8 > len(data):
        return
    struct.pack_into("<Q", data, pos, xxhash.xxh3_64_intdigest(bytes(data[:pos])))
    pos += 8 + (-(pos + 8) % 64)
    sums = []
    for _ in range(min(num_sections, 8)):
        if pos + 32 > len(data):
            return
        (payload_len,) = struct.unpack_from("<Q", data, pos + 8)
        end = pos + 32 + payload_len
        sums.append(xxhash.xxh3_64_intdigest(bytes(data[pos : pos + 16] + data[pos + 32 : end])))
        struct.pack_into("<Q", data, pos + 16, sums[-1])
        pos = end + (-end % 64)
    if pos + 16 <= len(data):
        summary = xxhash.xxh3_64_intdigest(b"".join(struct.pack("<Q", s) for s in sums))
        struct.pack_into("<Q", data, pos + 8, summary)


def _read_or_kvabi_error(data: bytes) -> Container | None:
    try:
        return read_container(data)
    except KvabiError:
        return None


def test_the_fuzz_base_is_valid() -> None:
    got = read_container(_valid())
    assert (got.token_ids, len(got.block_hashes), got.cache.extent) == (TOKENS, 2, 3)
    scrambled = bytearray(_valid())
    _reseal(scrambled)
    assert bytes(scrambled) == _valid()


@FUZZ
@given(st.lists(_mutation, min_size=1, max_size=3))
def test_mutations_read_equal_or_raise_kvabi_error(mutations: list) -> None:
    data = bytearray(_valid())
    for kind, pos, arg in mutations:
        _mutate(data, kind, pos, arg)
    got = _read_or_kvabi_error(bytes(data))
    if got is not None:
        assert _same(got, read_container(_valid()))


@FUZZ
@given(st.lists(_mutation, min_size=1, max_size=2))
def test_resealed_mutations_reach_later_checks_and_raise_only_kvabi_errors(mutations: list) -> None:
    data = bytearray(_valid())
    for kind, pos, arg in mutations:
        _mutate(data, kind, pos, arg)
    _reseal(data)
    got = _read_or_kvabi_error(bytes(data))
    if got is not None:  # a valid container again: it must be self-consistent
        assert len(container_bytes(got.cache, got.token_ids, got.block_hashes)) == len(data)
