"""Prefill side: the pooled blocks of a prompt the engine just prefilled, as a `KVPayload`.

Runs on the engine's thread, between steps (nothing can overwrite a block meanwhile). The
prompt's full blocks are found by block hash, as any later request would find them; the run
that is still pooled, from `start_token` on, is copied out in the engine's own layout. A
partial last block is not cached and not sent: the decode side computes those few tokens.
`layer_blocks` copies out one layer of a prompt's blocks, for sending layer by layer while the
forward goes on (kvabi/server/kv_roles.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvabi.abi.block_hash import hash_blocks
from kvabi.abi.buffers import layer_buffer_specs
from kvabi.cache.kv_storage import KVStorage
from kvabi.disagg.transport import FetchRequest, KVPayload
from kvabi.engine.engine import LLMEngine


def export_blocks(engine: LLMEngine, request: FetchRequest) -> KVPayload:
    """The prompt's pooled blocks from `request.start_token` up to the first missing one."""
    if engine.prefix is None:
        raise ValueError("prefill role: the engine needs its prefix cache to export blocks")
    bs = engine.config.block_size
    hashes = hash_blocks(request.token_ids, bs, engine.prefix.root(request.cache_salt))
    first = request.start_token // bs
    num_blocks = max(engine.prefix.num_pooled(hashes) - first, 0)
    block_ids = [engine.pool.cached_block(h) for h in hashes[first : first + num_blocks]]
    cache = engine.storage.read_blocks(block_ids)  # a copy: [num_blocks] blocks, own layout
    end = (first + num_blocks) * bs
    tokens = request.token_ids[request.start_token : end]
    return KVPayload(request.start_token, tuple(tokens), tuple(hashes[first:][:num_blocks]), cache)


def layer_blocks(storage: KVStorage, layer_id: int, block_ids: list[int]) -> dict[str, Tensor]:
    """A copy of one layer's `block_ids`, in the storage's layout: that layer's section of a
    container of these blocks (taken on the engine thread, before the blocks can be reused)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    return {
        spec.key: storage.buffers.tensors[spec.key].index_select(spec.dim("B"), index)
        for spec in layer_buffer_specs(storage.desc, layer_id, len(block_ids))
    }
