"""llama.cpp's iSWA state (base cache, then SWA cache) <-> kvabi, from hand-built bytes: three
layers (sliding, full, sliding; window 4), 10 tokens; the SWA cache holds the last 4 positions
as llama.cpp writes them, kvabi keeps the window of position 10 (7..9) and zeros before."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvabi.abi.descriptor import LayerSpec, ModelSpec
from kvabi.interop.errors import InteropError, ModelMismatchError, StateFormatError
from kvabi.interop.llamacpp_model import LlamaCacheFormat, buffers_to_state, state_to_buffers
from kvabi.interop.llamacpp_state import parse_state
from kvabi.interop.model_spec import model_spec_from_gguf_metadata

H, D, W, T = 1, 32, 4, 10
ATTN = LayerSpec(num_kv_heads=H, k_dim=D, v_dim=D)
SWA = replace(ATTN, window=W)
MODEL = ModelSpec(layers=(SWA, ATTN, SWA), rope_pairing="half")
BASE_POS = [3, 0, 9, 1, 8, 2, 7, 4, 6, 5]  # slot order is not position order
SWA_POS = [8, 6, 9, 7]  # llama.cpp's SWA cells for one seq: the last W positions


def rows(seed: int, cells: int) -> np.ndarray:
    """[cells, H*D] f16 values (exact), distinct per seed."""
    return (np.random.default_rng(seed).integers(1, 128, (cells, H * D)) / 16).astype(np.float16)


def memory(positions: list[int], num_layers: int, seed: int) -> bytes:
    """One KVCache's Memory with rows (v_trans 0), field by field from the grammar."""
    out = struct.pack("<II", 1, len(positions))
    for pos in positions:
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", 0, num_layers)
    for plane in range(2):  # all K, then all V
        for layer in range(num_layers):
            data = rows(seed + 10 * plane + layer, len(positions)).tobytes()
            out += struct.pack("<iQ", 1, H * D * 2) + data
    return out


def iswa_state(swa_pos: list[int] = SWA_POS) -> bytes:
    header = struct.pack("<Ii", 0xAF143CD8, 0)
    return header + memory(BASE_POS, 1, seed=100) + memory(swa_pos, 2, seed=200)


def test_parse_two_caches() -> None:
    state = parse_state(iswa_state())
    assert [c.pos for c in state.streams[0].cells] == BASE_POS
    assert [c.pos for c in state.swa_streams[0].cells] == SWA_POS
    assert (len(state.streams[0].k), len(state.swa_streams[0].k)) == (1, 2)


def test_sliding_layers_hold_the_window_only() -> None:
    buffers = state_to_buffers(iswa_state(), MODEL)
    assert buffers.desc.layout.name == "llamacpp-f16" and buffers.extent == T
    base_k = torch.from_numpy(rows(100, T)).view(T, H, D)  # in slot order
    assert torch.equal(buffers.tensors["1.k"][BASE_POS], base_k)
    for layer, j in ((0, 0), (2, 1)):  # model layer, index in the SWA cache
        for plane, seed in (("k", 200 + j), ("v", 210 + j)):
            got = buffers.tensors[f"{layer}.{plane}"]  # [T, H, D]
            assert not got[:7].any()  # position 6 is dropped: position 10 does not see it
            want = torch.from_numpy(rows(seed, 4)).view(4, H, D)
            assert torch.equal(got[[8, 9, 7]], want[[0, 2, 3]])  # the cells in slot order


def test_write_emits_both_caches_and_reads_back() -> None:
    buffers = state_to_buffers(iswa_state(), MODEL)
    data = buffers_to_state(buffers, MODEL, LlamaCacheFormat(1, 1, v_trans=True))
    state = parse_state(data)
    assert [c.pos for c in state.streams[0].cells] == list(range(T))
    assert [c.pos for c in state.swa_streams[0].cells] == [7, 8, 9]
    assert state.swa_streams[0].v_trans and len(state.swa_streams[0].v) == 2
    back = state_to_buffers(data, MODEL)
    for key, tensor in buffers.tensors.items():
        got = back.tensors[key]  # V^T now: [H, D, T]
        assert torch.equal(got if key.endswith(".k") else got.permute(2, 0, 1), tensor)


def test_short_sequence_keeps_every_position() -> None:
    data = struct.pack("<Ii", 0xAF143CD8, 0) + memory([1, 0], 1, 100) + memory([0, 1], 2, 200)
    buffers = state_to_buffers(data, MODEL)
    assert buffers.tensors["0.k"].all() and buffers.tensors["2.v"].all()


def test_refusals() -> None:
    with pytest.raises(StateFormatError, match="positions 7..9 .* holds 8..9 in 2 cells"):
        state_to_buffers(iswa_state([8, 9]), MODEL)
    with pytest.raises(ModelMismatchError, match="has 1 KV caches; a model with sliding"):
        state_to_buffers(struct.pack("<Ii", 0xAF143CD8, 0) + memory(BASE_POS, 3, 1), MODEL)
    full_only = replace(MODEL, layers=(ATTN,) * 3)
    with pytest.raises(ModelMismatchError, match="has 2 KV caches; a model without"):
        state_to_buffers(iswa_state(), full_only)
    two_full = replace(MODEL, layers=(SWA, ATTN, ATTN))
    with pytest.raises(ModelMismatchError, match="base cache has 1 KV layers; the model 2"):
        state_to_buffers(iswa_state(), two_full)
    buffers = state_to_buffers(iswa_state(), MODEL)
    with pytest.raises(InteropError, match="sliding layer 0 .* no KV at position 6"):
        buffers_to_state(buffers, MODEL, LlamaCacheFormat(), num_tokens=T - 1)
    with pytest.raises(StateFormatError, match="1 trailing bytes"):
        parse_state(iswa_state() + b"\0")  # a third cache: no such state


def test_gemma3_gguf_metadata_golden() -> None:
    """ABI 2.5's Gemma 3 270M golden, from the GGUF keys llama.cpp reads."""
    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 18,
        "gemma3.embedding_length": 640,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.sliding_window": "512",  # llama-cpp-python's metadata: strings
    }
    spec = model_spec_from_gguf_metadata(meta, "gemma3-270m")
    assert (
        spec.rope_pairing == "half" and spec.compat_digest() == "b47e2d916815e7615f23957aedf594f8"
    )
    pattern = [True, False] * 9
    explicit = model_spec_from_gguf_metadata(
        {**meta, "gemma3.attention.sliding_window_pattern": pattern}, "x"
    )
    assert [x.window for x in explicit.layers] == [512, 0] * 9
    every_third = model_spec_from_gguf_metadata(
        {**meta, "gemma3.attention.sliding_window_pattern": 3}, "x"
    )
    assert [x.window for x in every_third.layers] == [512, 512, 0] * 6
