"""A hybrid cache's blocks leave and enter the pool per block group: export, container, import.

The tiny hybrid Llama of test_hybrid_groups.py (layers 0, 2: a 6-token window; 1, 3: full
attention; blocks of 4). An export of a 24-token prefix carries the full group's 6 blocks and
only the 2 blocks the sliding group's window still needs (window_start(6, 24) = 19: blocks 4,
5); the rest of the sliding layers' buffers are zeros, and a container carries their tails only.
An engine that imports it continues greedily as the contiguous reference does.
"""

from __future__ import annotations

import io
import struct

import pytest
import torch

from kvabi.abi.buffers import layer_buffer_specs
from kvabi.wire import FormatError, read_container, write_container
from kvabi.wire import container_format as fmt
from tests.engine.test_hybrid_groups import GREEDY, PROMPTS, engine, hybrid_loaded
from tests.engine.tiny import greedy_reference, run_all

PROMPT = PROMPTS[0]  # 25 tokens: 6 full blocks of 4
SLIDING, FULL = (0, 2), (1, 3)


@pytest.fixture(scope="module")
def reference() -> tuple[int, ...]:
    return greedy_reference(PROMPT, GREEDY.max_tokens, loaded=hybrid_loaded())


@pytest.fixture(scope="module")
def exported():
    source = engine()
    run_all(source, [PROMPT], GREEDY)
    return source.cache.export(PROMPT, None)


def with_layer0(like, layer0: dict[str, torch.Tensor]):
    """`like` with layer 0's buffers replaced (to view them block by block)."""
    from kvabi.abi.buffers import CacheBuffers

    return CacheBuffers(like.desc, like.tensors | layer0)


def blocks_of(cache, layer_id: int) -> torch.Tensor:
    spec = layer_buffer_specs(cache.desc, layer_id, cache.extent)[0]
    return cache.tensors[spec.key].movedim(spec.dim("B"), 0)  # [blocks, ...]


def test_an_export_carries_each_groups_own_blocks(exported):
    assert exported.start_token == 0 and exported.token_ids == tuple(PROMPT[:24])
    assert len(exported.block_hashes) == exported.cache.extent == 6
    for layer in SLIDING:
        blocks = blocks_of(exported.cache, layer)
        assert not blocks[:4].any() and all(b.any() for b in blocks[4:])
    for layer in FULL:
        assert all(b.any() for b in blocks_of(exported.cache, layer))


def test_an_import_places_what_each_group_needs_and_continues(exported, reference):
    target = engine()
    keys = target.cache.hasher.keys(PROMPT, None)
    assert target.cache.held(keys) == 0
    result = target.cache.import_blocks(PROMPT, None, exported)
    assert (result.num_cached_tokens, result.num_placed_blocks) == (24, 6 + 2)
    assert target.cache.held(keys) == 6
    again = target.cache.import_blocks(PROMPT, None, exported)
    assert (again.num_cached_tokens, again.num_placed_blocks) == (24, 0)
    out = run_all(target, [PROMPT], GREEDY)[0]
    assert tuple(out.outputs[0].token_ids) == reference
    assert target.cache.stats.prefix.hit_tokens == 24


def test_a_delta_export_completes_what_the_importer_holds(reference):
    source, target = engine(), engine()
    run_all(source, [PROMPT], GREEDY)
    run_all(target, [PROMPT[:9]], GREEDY)  # holds the prompt's blocks 0, 1 in both groups
    held = target.cache.held(target.cache.hasher.keys(PROMPT, None))
    assert held == 2
    payload = source.cache.export(PROMPT, None, start_token=held * 4)
    assert payload.cache.extent == 4 and payload.start_token == 8
    result = target.cache.import_blocks(PROMPT, None, payload)
    assert (result.num_cached_tokens, result.num_placed_blocks) == (24, 4 + 2)
    out = run_all(target, [PROMPT], GREEDY)[0]
    assert tuple(out.outputs[0].token_ids) == reference


def container_of(payload) -> bytes:
    sink = io.BytesIO()
    write_container(sink, payload.cache, list(payload.token_ids), list(payload.block_hashes))
    return sink.getvalue()


def test_a_container_carries_the_sliding_layers_tails_only(exported, reference):
    data = container_of(exported)
    header = fmt.Header.parse(memoryview(data)[: fmt.HEADER.size])
    assert (header.minor, header.flags) == (1, fmt.FLAG_WINDOW_TAILS)
    layouts = fmt.section_layouts(exported.cache.desc, 24)
    assert [x.first for x in layouts] == [4, 0, 4, 0]
    block = layer_buffer_specs(exported.cache.desc, 1, 1)[0].num_bytes
    assert [x.payload_len for x in layouts] == [2 * block, 6 * block, 2 * block, 6 * block]
    back = read_container(data, expect=exported.cache.desc.model)
    for key, t in exported.cache.tensors.items():
        assert torch.equal(back.cache.tensors[key], t), key
    target = engine()
    assert target.cache.import_blocks(PROMPT, None, _payload(back)).num_placed_blocks == 8
    assert tuple(run_all(target, [PROMPT], GREEDY)[0].outputs[0].token_ids) == reference


def _payload(container):
    from kvabi.cache.kv_cache import KVPayload

    hashes = tuple(container.block_hashes)
    return KVPayload(0, tuple(container.token_ids), hashes, container.cache)


def untailed(payload, monkeypatch) -> bytes:
    """The container a writer without the window-tails rule makes (1.0: whole sections)."""
    with monkeypatch.context() as m:
        m.setattr(fmt, "flags_for", lambda desc: 0)
        fmt.section_layouts.cache_clear()
        data = container_of(payload)
    fmt.section_layouts.cache_clear()
    return data


def test_a_container_without_the_flag_is_read_whole(exported, monkeypatch):
    data = untailed(exported, monkeypatch)
    header = fmt.Header.parse(memoryview(data)[: fmt.HEADER.size])
    assert (header.minor, header.flags) == (0, 0)
    assert len(data) > len(container_of(exported))
    back = read_container(data, expect=exported.cache.desc.model)
    assert all(torch.equal(back.cache.tensors[k], t) for k, t in exported.cache.tensors.items())


def test_a_sliding_section_holding_tokens_outside_its_window_is_refused(exported, monkeypatch):
    data = bytearray(untailed(exported, monkeypatch))  # whole sections ...
    struct.pack_into("<I", data, 12, fmt.FLAG_WINDOW_TAILS)  # ... claimed as tails
    header = fmt.Header.parse(memoryview(data)[: fmt.HEADER.size])
    meta_end = header.meta_len
    struct.pack_into("<Q", data, meta_end, fmt.checksum(memoryview(data)[:meta_end]))
    with pytest.raises(
        FormatError, match=r"section 0 \(layer 0\).*a 6-token window: blocks/slots 4 on"
    ):
        read_container(bytes(data))


def test_a_shorter_prefix_of_a_sliding_payload_is_never_placed(exported):
    """With room for 7 blocks (the 24-token prefix needs 8), a 20-token prefix would need the
    sliding layers' tokens 15 .. 18, which the payload (sent for 24: from 19 on) holds as
    zeros: nothing is placed, rather than zeros as KV."""
    small = engine(num_blocks=7)
    result = small.cache.import_blocks(PROMPT, None, exported)
    assert (result.num_cached_tokens, result.num_placed_blocks) == (0, 0)
    assert small.cache.pool.num_cached == 0


def test_staging_into_larger_blocks_drops_a_sliding_payload_it_would_cut(exported):
    from kvabi.transfer.kv_staging import stage_payload

    desc = exported.cache.desc
    assert stage_payload(exported, desc.with_layout(block_size=8)).cache.extent == 3  # 24: whole
    cut = stage_payload(exported, desc.with_layout(block_size=16))  # 16 of 24: zeros at 11..18
    assert cut.token_ids == () and cut.cache.extent == 0


def test_tiers_hold_each_groups_blocks_and_complete_a_prefix(reference):
    from kvabi.cache.group_blocks import group_key
    from kvabi.cache.tier_config import TierConfig

    e = engine(num_blocks=24, tiers=TierConfig(host_bytes=2**20))
    run_all(e, [PROMPT], GREEDY)
    keys = e.cache.hasher.keys(PROMPT, None)
    for start in (100, 130, 160):  # each takes most of the pool: PROMPT's blocks go down
        run_all(e, [list(range(start, start + 30))], GREEDY)
    e.cache.flush()
    sliding, full = (g.group_id for g in e.cache.groups)
    assert e.cache.cached_in(full, keys[0].block_hash) is None  # evicted from the pool
    host = e.cache.tiers.tier("host")
    assert host.contains_many([group_key(k, full).block_hash for k in keys]) == [True] * 6
    assert all(host.contains_many([group_key(k, sliding).block_hash for k in keys[4:]]))
    assert not any(host.contains_many([k.block_hash for k in keys]))  # no ungrouped entry
    assert e.cache.held(keys) == 6  # from the host tier: the full group's 6, the window's 2
    assert [e.cache.cached_in(sliding, k.block_hash) is not None for k in keys[:4]] == [0] * 4
    out = run_all(e, [PROMPT], GREEDY)[0]
    assert tuple(out.outputs[0].token_ids) == reference
    assert e.cache.stats.prefix.hit_tokens == 24


@pytest.mark.parametrize("chunk", [512, 8])
def test_a_layer_exported_mid_forward_is_the_exports_layer(chunk):
    """What a prefill instance streams (each layer as the forward stores it, with the
    sequence's per-group tables) is, layer by layer, the whole export; chunked prefill
    releases the sliding blocks before the window without losing one the export needs."""
    from kvabi.engine.engine import EngineConfig, EngineHooks, LLMEngine

    streamed: dict[int, dict[str, torch.Tensor]] = {}

    def hook(cache, layer_id, seqs):
        (seq,) = seqs
        streamed[layer_id] = cache.export_layer(layer_id, seq.block_tables, slice(0, 6))

    config = EngineConfig(block_size=4, max_num_batched_tokens=chunk)
    e = LLMEngine(hybrid_loaded(), config, "hybrid", EngineHooks(on_prompt_layer=hook))
    run_all(e, [PROMPT[:24]], GREEDY)  # a kvabi decode asks for whole blocks of both sizes
    assert sorted(streamed) == [0, 1, 2, 3]
    whole = e.cache.export(PROMPT[:24], None).cache  # the same engine's (same rounding)
    for layer_id, tensors in streamed.items():
        for spec in layer_buffer_specs(whole.desc, layer_id, 6):
            assert torch.equal(tensors[spec.key], whole.tensors[spec.key]), layer_id
    sliding = blocks_of(with_layer0(whole, streamed[0]), 0)  # window_start(6, 24) = 19
    assert not sliding[:4].any() and all(b.any() for b in sliding[4:])


def test_a_layer_whose_window_released_a_needed_block_is_refused():
    e = engine(max_num_batched_tokens=8)
    run_all(e, [PROMPT], GREEDY)
    released = [[-1] * 6, list(range(6))]  # group 0 slides: all its blocks released
    with pytest.raises(ValueError, match="layer 0's window released a block it needs"):
        e.cache.export_layer(0, released, slice(0, 6))
