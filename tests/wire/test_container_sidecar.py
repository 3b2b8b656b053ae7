"""Containers and tier entries of a model with an indexer plane (DeepSeek V3.2): the plane
travels in its layer's section, and anything that lacks it, or carries it to a model without
one, is refused with a typed error naming the plane; nothing of such a container is returned."""

from __future__ import annotations

import io
import struct

import pytest

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import MLA, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.errors import IncompatibleError, MissingPlaneError
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_codec import BlockCodec
from kvabi.cache.block_hasher import BlockKey
from kvabi.wire import (
    ContainerWriter,
    FormatError,
    SectionPlaneError,
    container_bytes,
    iter_layers,
    read_container,
)
from kvabi.wire.container_format import U64, Header, checksum, padding
from tests.wire.container_cases import filled, raw, section_offsets

DSA = LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=8)
PLAIN = LayerSpec(MLA, latent_dim=16, rope_dim=8)
V32 = preset_descriptor("vllm-mla", ModelSpec((DSA, DSA), "v32"), block_size=4)
V3 = preset_descriptor("vllm-mla", ModelSpec((PLAIN, PLAIN), "v32"), block_size=4)
TOKENS = [1, 2, 3, 4, 5, 6]


def _redeclared(data: bytes, desc: Descriptor) -> bytes:
    """`data`'s sections (checksums intact) under another descriptor: what a writer that
    declares the indexer plane but never wrote it would send."""
    text = desc.to_json().encode()
    desc_len, num_tokens, num_hashes, num_sections = struct.unpack_from("<IIII", data, 16)
    ids = data[32 + desc_len : 32 + desc_len + 4 * num_tokens + 32 * num_hashes]
    header = Header.for_desc(desc, len(text), num_tokens, num_hashes, num_sections).pack()
    meta = header + text + ids
    meta += U64.pack(checksum(meta))
    return meta + bytes(padding(len(meta))) + data[section_offsets(data)[0] :]


def test_the_indexer_travels_in_its_layers_section():
    cache = filled(V32, 2)
    got = read_container(container_bytes(cache, TOKENS), expect=V32.model).cache
    assert sorted(got.tensors) == ["0", "0.indexer", "1", "1.indexer"]
    assert all(raw(got.tensors[k]) == raw(cache.tensors[k]) for k in got.tensors)


def test_a_container_declaring_the_indexer_without_its_bytes_is_refused():
    forged = _redeclared(container_bytes(filled(V3, 2), TOKENS), V32)
    with pytest.raises(SectionPlaneError, match="layer 0 lacks its 'indexer' plane") as info:
        read_container(forged)
    assert isinstance(info.value, FormatError) and isinstance(info.value, MissingPlaneError)
    assert (info.value.layer_id, info.value.plane) == (0, "indexer")
    layers = iter_layers(io.BytesIO(forged))
    next(layers)  # the meta
    with pytest.raises(SectionPlaneError):  # before layer 0 is handed to anyone
        next(layers)


def test_the_writer_refuses_a_layer_without_its_indexer():
    cache = filled(V32, 2)
    writer = ContainerWriter(io.BytesIO(), V32, TOKENS)
    with pytest.raises(MissingPlaneError, match="'indexer'"):
        writer.write_layer(0, {"0": cache.tensors["0"]})


@pytest.mark.parametrize(("written", "expected"), [(V32, V3), (V3, V32)])
def test_a_container_is_refused_by_a_model_that_differs_in_the_plane(written, expected):
    data = container_bytes(filled(written, 2), TOKENS)
    with pytest.raises(IncompatibleError, match="plane 'indexer'"):
        read_container(data, expect=expected.model)


def _entry(desc: Descriptor) -> tuple[bytes, BlockKey, CacheBuffers]:
    tokens = TOKENS[:4]
    (block_hash,) = hash_blocks(tokens, 4, root_hash(desc.model.compat_digest()))
    key = BlockKey(block_hash, tuple(tokens))
    cache = filled(desc, 1)
    return BlockCodec(desc).encode(cache, 0, key), key, cache


def test_a_tier_entry_keeps_the_indexer_and_one_without_it_is_refused():
    entry, key, cache = _entry(V32)
    got = BlockCodec(V32).decode(entry, key)
    assert raw(got.tensors["1.indexer"]) == raw(cache.tensors["1.indexer"])
    # An entry stored by a tier that dropped the sidecar: same block, same hash, no plane.
    (block_hash,) = hash_blocks(TOKENS[:4], 4, root_hash(V32.model.compat_digest()))
    stripped = container_bytes(filled(V3, 1), TOKENS[:4], [block_hash])
    with pytest.raises(SectionPlaneError, match="'indexer'"):
        BlockCodec(V32).decode(_redeclared(stripped, V32), key)


@pytest.mark.parametrize(("written", "reader"), [(V32, V3), (V3, V32)])
def test_a_tier_entry_of_a_model_that_differs_in_the_plane_is_refused(written, reader):
    entry, key, _ = _entry(written)
    with pytest.raises(IncompatibleError, match="plane 'indexer'"):
        BlockCodec(reader).decode(entry, BlockKey(key.block_hash, key.token_ids))
