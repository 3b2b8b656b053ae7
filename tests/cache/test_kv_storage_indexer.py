"""`KVStorage` of a DeepSeek V3.2 cache: its indexer plane holds each token's key as vLLM's
`DeepseekV32IndexerCache` does (a block's codes token-major, then its float32 scales), written
at the tokens' slots and read back dequantised; whole-block reads carry it with the latents."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi.descriptor import MLA, LayerSpec, ModelSpec
from kvabi.abi.indexer_record import decode_blocks, encode_blocks
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.kv_storage import KVStorage

DIM, BLOCK = 8, 4
DSA = LayerSpec(MLA, latent_dim=16, rope_dim=8, indexer_dim=DIM)
V32 = preset_descriptor("vllm-mla", ModelSpec((DSA, DSA), "v32"), block_size=BLOCK)
V3 = preset_descriptor(
    "vllm-mla", ModelSpec((LayerSpec(MLA, latent_dim=16, rope_dim=8),) * 2, "v3"), block_size=BLOCK
)


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed)) * 3


def test_indexer_keys_are_stored_as_vllms_blocks_at_their_slots() -> None:
    storage = KVStorage(V32, 5)
    assert storage.has_indexer and not KVStorage(V3, 5).has_indexer
    keys = _keys(7)  # tokens 0..6 of a sequence in blocks 3, 1 (slots 0..3, 0..2)
    table = torch.tensor([3, 1])
    pos = torch.arange(7)
    storage.write_indexer(1, table[pos // BLOCK], pos % BLOCK, keys)
    buf = storage.buffers.tensors["1.indexer"]  # [5, BLOCK * (DIM + 4)] u8
    want = encode_blocks(keys, BLOCK)  # [2, BLOCK * (DIM + 4)], the last slot zero
    assert torch.equal(buf[3], want[0]) and torch.equal(buf[1], want[1])
    assert not buf[[0, 2, 4]].any() and not storage.buffers.tensors["0.indexer"].any()
    got = storage.indexer_keys(1, table, 7)  # [7, DIM] float32
    assert torch.equal(got, decode_blocks(want, DIM)[:7])
    assert (
        (got - keys).abs() <= keys.abs() * 2**-4 + keys.abs().amax(-1, keepdim=True) / 448
    ).all()


def test_whole_blocks_carry_the_indexer_with_the_latents() -> None:
    storage = KVStorage(V32, 6)
    pos = torch.arange(BLOCK * 2)
    storage.write_indexer(0, 2 + pos // BLOCK, pos % BLOCK, _keys(8, seed=1))
    storage.copy_blocks([2, 3], [4, 5])
    assert torch.equal(storage.indexer_keys(0, torch.tensor([4, 5]), 8),
                       storage.indexer_keys(0, torch.tensor([2, 3]), 8))  # fmt: skip
    copy = storage.read_blocks([3])
    assert torch.equal(copy.tensors["0.indexer"][0], storage.buffers.tensors["0.indexer"][3])
    other = KVStorage(V32, 6)
    other.write_blocks(copy, [0])
    assert torch.equal(other.buffers.tensors["0.indexer"][0], copy.tensors["0.indexer"][0])


def test_a_layer_without_the_plane_has_no_indexer_keys() -> None:
    with pytest.raises(ValueError, match="no indexer plane"):
        KVStorage(V3, 2).indexer_keys(0, torch.tensor([0]), 1)
