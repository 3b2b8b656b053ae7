"""KV memory per group (`group_memory`, `plan`): figures worked out by hand for a hybrid model."""

from __future__ import annotations

import pytest

from kvabi.abi.descriptor import LayerSpec, ModelSpec
from kvabi.abi.plan import group_memory, plan
from kvabi.abi.presets import preset_descriptor

SLIDING = LayerSpec(num_kv_heads=1, k_dim=8, v_dim=8, window=10)
FULL = LayerSpec(num_kv_heads=1, k_dim=8, v_dim=8)
# K and V of 1 head x 8 bf16 values: 32 bytes per token per layer
DESC = preset_descriptor("vllm-flash-attn", ModelSpec((SLIDING, FULL, SLIDING), "t"), block_size=4)


def test_a_sliding_group_holds_only_the_blocks_its_window_still_needs():
    """At 21 tokens the next query (position 21) needs keys 12..21: blocks 3..5 (12 token slots)
    of the sliding layers, blocks 0..5 (24 slots) of the full one."""
    sliding, full = group_memory(DESC, 21)
    assert sliding.group.layer_ids == (0, 2) and full.group.layer_ids == (1,)
    assert (sliding.bytes_per_token, sliding.held_tokens, sliding.bytes_per_request) == (
        64,
        12,
        768,
    )
    assert (full.bytes_per_token, full.held_tokens, full.bytes_per_request) == (32, 24, 768)
    p = plan(DESC, 21, concurrency=3)
    assert (p.bytes_per_token, p.bytes_per_request, p.total_bytes) == (96, 1536, 3 * 1536)


def test_inside_the_window_a_sliding_group_holds_every_block():
    sliding, full = group_memory(DESC, 7)  # keys 0..7 needed: blocks 0, 1
    assert sliding.held_tokens == full.held_tokens == 8


def test_bad_context_is_refused():
    with pytest.raises(ValueError, match="context"):
        group_memory(DESC, 0)
