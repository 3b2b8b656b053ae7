"""KV memory planning: bytes per token, per request and per fleet of requests, from a descriptor.

Per KV group (kvabi/abi/kv_groups.py): a full-attention group holds every block of a request,
a sliding group only the blocks its window still needs at the planned context, so a hybrid
model's request costs less than its layers at full context.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.kv_groups import KVGroup, kv_groups, window_start


@dataclass(frozen=True)
class KVPlan:
    bytes_per_token: float  # amortised over whole blocks, every layer
    bytes_per_request: int  # whole blocks for `context` tokens (sliding groups: their window)
    total_bytes: int  # `concurrency` requests at full context
    context: int
    concurrency: int


@dataclass(frozen=True)
class GroupMemory:
    """One KV group's share of a request of `context` tokens."""

    group: KVGroup
    bytes_per_token: float  # the group's layers, amortised over whole blocks
    held_tokens: int  # token slots it holds (whole blocks; a sliding group: its window's)
    bytes_per_request: int


def group_memory(desc: Descriptor, context: int) -> tuple[GroupMemory, ...]:
    """Each KV group's bytes per token and per request of `context` tokens (one TP shard)."""
    _check(context)
    out = []
    for g in kv_groups(desc.model):
        sub = Descriptor(ModelSpec((g.spec,) * len(g.layer_ids), desc.model.fingerprint),
                         desc.layout)  # fmt: skip
        out.append(_memory(sub, g, context))
    return tuple(out)


def _memory(sub: Descriptor, g: KVGroup, context: int) -> GroupMemory:
    lay, first = sub.layout, window_start(g.window, context)
    if lay.is_paged:
        bs = lay.block_size
        blocks = -(-context // bs) - first // bs
        per_request = sum(s.num_bytes for s in buffer_specs(sub, blocks))
        per_token = sum(s.num_bytes for s in buffer_specs(sub, 1)) / bs
        return GroupMemory(g, per_token, blocks * bs, per_request)
    tokens = context - first
    per_request = sum(s.num_bytes for s in buffer_specs(sub, tokens))
    return GroupMemory(g, per_request / tokens, tokens, per_request)


def plan(desc: Descriptor, context: int, concurrency: int = 1) -> KVPlan:
    """Memory a cache in `desc`'s layout needs for requests of `context` tokens (one TP shard)."""
    _check(context, concurrency)
    groups = group_memory(desc, context)
    per_token = sum(g.bytes_per_token for g in groups)
    per_request = sum(g.bytes_per_request for g in groups)
    return KVPlan(per_token, per_request, per_request * concurrency, context, concurrency)


def _check(context: int, concurrency: int = 1) -> None:
    if context < 1 or concurrency < 1:
        raise ValueError(f"context and concurrency must be >= 1, got {context}, {concurrency}")
