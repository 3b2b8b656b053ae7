"""Prefill side: the pooled blocks of a prompt the engine just prefilled, as a `KVPayload`.

Runs on the engine's thread, between steps (nothing can overwrite a block meanwhile). The
prompt's full blocks are found by block hash, as any later request would find them; the run
that is still pooled, from `start_token` on, is copied out in the engine's own layout. A
partial last block is not cached and not sent: the decode side computes those few tokens.
"""

from __future__ import annotations

from kvabi.abi.block_hash import hash_blocks
from kvabi.disagg.transport import FetchRequest, KVPayload
from kvabi.engine.engine import LLMEngine


def export_blocks(engine: LLMEngine, request: FetchRequest) -> KVPayload:
    """The prompt's pooled blocks from `request.start_token` up to the first missing one."""
    if engine.prefix is None:
        raise ValueError("prefill role: the engine needs its prefix cache to export blocks")
    bs = engine.config.block_size
    salt = None if request.cache_salt is None else {"cache_salt": request.cache_salt}
    hashes = hash_blocks(request.token_ids, bs, engine.prefix.root(salt))
    first = request.start_token // bs
    num_blocks = max(engine.prefix.num_pooled(hashes) - first, 0)
    block_ids = [engine.pool.cached_block(h) for h in hashes[first : first + num_blocks]]
    cache = engine.storage.read_blocks(block_ids)  # a copy: [num_blocks] blocks, own layout
    end = (first + num_blocks) * bs
    tokens = request.token_ids[request.start_token : end]
    return KVPayload(request.start_token, tuple(tokens), tuple(hashes[first:][:num_blocks]), cache)
