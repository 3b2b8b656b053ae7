"""KV memory planning: bytes per token, per request and per fleet of requests, from a descriptor."""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.descriptor import Descriptor


@dataclass(frozen=True)
class KVPlan:
    bytes_per_token: float  # amortised over whole blocks
    bytes_per_request: int  # whole blocks for `context` tokens
    total_bytes: int  # `concurrency` requests at full context
    context: int
    concurrency: int


def plan(desc: Descriptor, context: int, concurrency: int = 1) -> KVPlan:
    """Memory a cache in `desc`'s layout needs for requests of `context` tokens (one TP shard)."""
    if context < 1 or concurrency < 1:
        raise ValueError(f"context and concurrency must be >= 1, got {context}, {concurrency}")
    lay = desc.layout
    if lay.is_paged:
        blocks = -(-context // lay.block_size)
        per_request = sum(s.num_bytes for s in buffer_specs(desc, blocks))
        per_token = sum(s.num_bytes for s in buffer_specs(desc, 1)) / lay.block_size
    else:
        per_request = sum(s.num_bytes for s in buffer_specs(desc, context))
        per_token = per_request / context
    return KVPlan(per_token, per_request, per_request * concurrency, context, concurrency)
