"""The vLLM CPU cache adapter on caches built by vLLM's packing formulas (no vLLM needed).

tests/interop/test_vllm_handoff.py runs the same adapter on a real vLLM process."""

from dataclasses import replace

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, Layout
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import InteropError, ModelMismatchError, UnsupportedTypeError
from kvabi.interop.vllm_cache import (
    kv_caches_to_buffers,
    read_group_sequence,
    read_sequence,
    store_ratio,
    vllm_cpu_descriptor,
    write_group_sequence,
    write_sequence,
)
from tests.abi.test_vllm_cpu_presets import MODEL, T, _engine_cache

BS = 32
BLOCK_TABLE = [3, 1, 4]  # vLLM never hands out block 0
ISAS = {"vllm-cpu-vec": "vec", "vllm-cpu-amx": "amx"}


def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"{l}.{p}": torch.randn(T, 2, 32, generator=g).bfloat16().float()
        for l in range(2)
        for p in "kv"
    }


def _vllm_tensors(name: str, values: dict) -> list[torch.Tensor]:
    """Per layer [num_blocks, H, block_size, 2D], as vLLM allocates and fills them."""
    return list(_engine_cache(name, values, BS, BLOCK_TABLE).unbind(0))


@pytest.mark.parametrize("name", sorted(ISAS))
def test_vllm_tensors_are_viewed_in_place_and_read_per_sequence(name):
    values = _values()
    tensors = _vllm_tensors(name, values)
    cache = kv_caches_to_buffers(tensors, MODEL, ISAS[name])
    assert cache.desc.layout.name == name and cache.desc.layout.block_size == BS
    assert cache.tensors["1"].data_ptr() == tensors[1].data_ptr()  # a view, not a copy
    seq = read_sequence(cache, BLOCK_TABLE, T)
    assert seq.extent == 3 and seq.desc == cache.desc
    canon = Descriptor(MODEL, Layout("THC", 0, "f32", planes="separate"))
    back = convert(seq, canon, num_tokens=T)
    assert all(torch.equal(back.tensors[k], v) for k, v in values.items())


@pytest.mark.parametrize("name", sorted(ISAS))
def test_write_sequence_fills_vllm_blocks_as_vllm_would(name):
    values = _values(1)
    want = _vllm_tensors(name, values)
    got = [torch.zeros_like(t) for t in want]
    src = CacheBuffers(Descriptor(MODEL, Layout("THC", 0, "f32", planes="separate")), values)
    write_sequence(src, kv_caches_to_buffers(got, MODEL, ISAS[name]), BLOCK_TABLE, T)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_refusals():
    tensors = _vllm_tensors("vllm-cpu-vec", _values())
    with pytest.raises(UnsupportedTypeError, match="vec16"):
        kv_caches_to_buffers(tensors, MODEL, "vec16")
    with pytest.raises(UnsupportedTypeError, match="fp8"):
        vllm_cpu_descriptor(MODEL, "amx", torch.float8_e4m3fn)
    with pytest.raises(ModelMismatchError):
        kv_caches_to_buffers(tensors[:1], MODEL, "vec")
    cache = kv_caches_to_buffers(tensors, MODEL, "vec")
    with pytest.raises(InteropError, match="null block"):
        read_sequence(cache, [0, 1, 4], T)


def test_store_block_size_must_divide_vllms():
    """The connector's store entries tile vLLM's blocks, or the connector refuses to start."""
    assert store_ratio(128, preset_descriptor("vllm-flash-attn", MODEL, block_size=16)) == 8
    assert store_ratio(128, preset_descriptor("vllm-cpu-amx", MODEL, block_size=128)) == 1
    with pytest.raises(IncompatibleError, match="not a multiple of the store's block size 48"):
        store_ratio(128, preset_descriptor("vllm-flash-attn", MODEL, block_size=48))
    with pytest.raises(IncompatibleError, match="not a multiple"):
        store_ratio(128, preset_descriptor("vllm-flash-attn", MODEL, block_size=256))
    with pytest.raises(IncompatibleError, match="paged"):
        store_ratio(128, preset_descriptor("hf-dynamic", MODEL))


# Gemma 3 in vLLM: layer 0 slides (window 40), layer 1 is full. Each layer's blocks sit in its
# KV cache group's table; the sliding group's holds the null block where the window moved on.
HYBRID = replace(MODEL, layers=(replace(MODEL.layers[0], window=40), MODEL.layers[1]))
SLIDING_TABLE, FULL_TABLE = [0, 5, 6], [3, 1, 6]
FIRST_NEEDED = (T - 40 + 1) // BS * BS  # the sliding layer's first block's first token


def _hybrid_tensors(name: str, values: dict) -> list[torch.Tensor]:
    """Layer 0 as vLLM fills it through the sliding table (block 2 stands in for the freed
    block 0 and is then zeroed), layer 1 through the full table."""
    sliding = _engine_cache(name, values, BS, [2, *SLIDING_TABLE[1:]])[0]
    sliding[2] = 0
    return [sliding, _engine_cache(name, values, BS, FULL_TABLE)[1]]


@pytest.mark.parametrize("name", sorted(ISAS))
def test_hybrid_sequences_read_each_layer_through_its_groups_table(name):
    assert 0 < FIRST_NEEDED < T  # the window reaches back past block 0, not to the start
    values = _values(2)
    cache = kv_caches_to_buffers(_hybrid_tensors(name, values), HYBRID, ISAS[name])
    seq = read_group_sequence(cache, [SLIDING_TABLE, FULL_TABLE], T)
    canon = Descriptor(HYBRID, Layout("THC", 0, "f32", planes="separate"))
    back = convert(seq, canon, num_tokens=T)
    for plane in "kv":
        assert torch.equal(back.tensors[f"1.{plane}"], values[f"1.{plane}"])
        got, want = back.tensors[f"0.{plane}"], values[f"0.{plane}"]
        assert torch.equal(got[FIRST_NEEDED:], want[FIRST_NEEDED:])
        assert not got[:FIRST_NEEDED].any()  # outside the window: zeros, not the null block


@pytest.mark.parametrize("name", sorted(ISAS))
def test_hybrid_writes_fill_only_the_blocks_each_layer_needs(name):
    values = _values(3)
    want = _hybrid_tensors(name, values)
    got = [torch.zeros_like(t) for t in want]
    got[0][2] = 7  # a block the window no longer needs: left as it is
    src = CacheBuffers(Descriptor(HYBRID, Layout("THC", 0, "f32", planes="separate")), values)
    write_group_sequence(
        src, kv_caches_to_buffers(got, HYBRID, ISAS[name]), [SLIDING_TABLE, FULL_TABLE], T
    )
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0][5:7], want[0][5:7]) and bool((got[0][2] == 7).all())


def test_hybrid_refuses_a_needed_block_that_is_null_or_missing():
    cache = kv_caches_to_buffers(_hybrid_tensors("vllm-cpu-vec", _values()), HYBRID, "vec")
    with pytest.raises(InteropError, match="layer 0 .window 40.: block 1.*null block"):
        read_group_sequence(cache, [[0, 0, 6], FULL_TABLE], T)
    with pytest.raises(InteropError, match="layer 1: a table of 2 blocks"):
        read_group_sequence(cache, [SLIDING_TABLE, FULL_TABLE[:2]], T)
    with pytest.raises(ModelMismatchError, match="1 block tables for 2 layers"):
        read_group_sequence(cache, [FULL_TABLE], T)
