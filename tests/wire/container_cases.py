"""Shared cases of the container tests: descriptors, filled caches, byte-offset helpers."""

from __future__ import annotations

import struct

import torch
import xxhash

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.wire import container_bytes

ATTN = LayerSpec("attn", 2, 16, 16)
TINY = Descriptor(
    ModelSpec((LayerSpec("attn", 1, 8, 8),), fingerprint="tiny"),
    Layout(axes="KBNHC", block_size=4, dtype="f16"),
)
TINY_TOKENS = [1, 2, 3, 4, 5]

DESCRIPTORS = {
    "paged_KBNHC_bf16": Descriptor(
        ModelSpec((ATTN, ATTN), fingerprint="a"), Layout(axes="KBNHC", block_size=4, dtype="bf16")
    ),
    "unpaged_separate_HCT_f16": Descriptor(
        ModelSpec(
            (ATTN, LayerSpec("shared", shares=0), LayerSpec("attn", 1, 8, 8)), fingerprint="b"
        ),
        Layout(axes="THC", block_size=0, dtype="f16", planes="separate", v_axes="HCT"),
    ),
    "mla_concat": Descriptor(
        ModelSpec((LayerSpec("mla", latent_dim=32, rope_dim=8),) * 2, fingerprint="c"),
        Layout(axes="BNHC", block_size=4, dtype="bf16", planes="concat"),
    ),
    "per_token_head_int8": Descriptor(
        ModelSpec((ATTN, ATTN), fingerprint="d"),
        Layout(axes="KBNHC", block_size=2, dtype="int8", quant="per_token_head"),
    ),
}


def filled(desc: Descriptor, extent: int, seed: int = 0) -> CacheBuffers:
    """A cache of random bit patterns (NaNs included: comparisons are on raw bytes)."""
    g = torch.Generator().manual_seed(seed)
    cache = CacheBuffers.empty(desc, extent)
    for t in cache.tensors.values():
        data = t.view(torch.uint8)
        data.copy_(torch.randint(0, 256, data.shape, generator=g, dtype=torch.uint8))
    return cache


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, for bit-exact comparison."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tiny() -> tuple[CacheBuffers, list[bytes], bytes]:
    """The golden-vector container: one f16 layer of 1x8, 5 tokens in blocks of 4, one hash."""
    cache = CacheBuffers.empty(TINY, 2)
    t = cache.tensors["0"]  # [K=2, B=2, N=4, H=1, C=8]
    t.copy_(torch.arange(t.numel(), dtype=torch.float16).reshape(t.shape))
    hashes = hash_blocks(TINY_TOKENS, 4, root_hash(TINY.model.compat_digest()))
    return cache, hashes, container_bytes(cache, TINY_TOKENS, hashes)


def reseal_meta(data: bytearray) -> None:
    """Recompute the meta checksum after editing the header or meta (tests of later checks)."""
    desc_len, num_tokens, num_hashes = struct.unpack_from("<III", data, 16)
    end = 32 + desc_len + 4 * num_tokens + 32 * num_hashes
    struct.pack_into("<Q", data, end, xxhash.xxh3_64_intdigest(bytes(data[:end])))


def section_offsets(data: bytes) -> list[int]:
    """Byte offsets of the section headers, found by walking payload_len from the first."""
    offsets, pos = [], data.index(b"KVSC")
    while data[pos : pos + 4] == b"KVSC":
        offsets.append(pos)
        (payload_len,) = struct.unpack_from("<Q", data, pos + 8)
        pos += 32 + payload_len
        pos += -pos % 64
    return offsets
