"""`ForeignPrefillProvider`: what every foreign engine's prefill instance shares.

An engine that is not kvabi (HF transformers, llama.cpp) computes the KV of a prompt's full
blocks in its own layout, positions 0..T-1 of one sequence (a subclass's `prefill`).
`foreign_payload` does the rest, the same for every engine: re-blocks that cache into the
instance's paged descriptor by the one conversion path (`kvabi.abi.convert`), hashes the blocks
with the portable block hash (rooted at the model's compat digest and the request's cache salt,
as a kvabi instance hashes them), and keeps the blocks from `start_token` on. The partial last
block is neither computed nor sent: the decode side computes those few tokens itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_hasher import BlockHasher
from kvabi.cache.kv_cache import FetchRequest, KVPayload

PrefillFn = Callable[[list[int]], CacheBuffers]  # token ids -> their KV, any layout


class ForeignPrefillProvider:
    """A `KVProvider` over another engine (one prompt at a time): `desc` is the paged layout
    it serves, of the engine's own model part `spec` and K/V `dtype`."""

    def __init__(self, spec: ModelSpec, dtype: str, block_size: int, layout: str) -> None:
        self.spec = spec
        self.desc: Descriptor = preset_descriptor(layout, spec, block_size=block_size, dtype=dtype)
        self._lock = threading.Lock()

    def __call__(self, request: FetchRequest) -> KVPayload:
        """Prefill the prompt's full blocks; return those from `start_token` on."""
        with self._lock:
            return foreign_payload(request, self.desc, self.prefill)

    def prefill(self, token_ids: list[int]) -> CacheBuffers:
        """The engine's KV of `token_ids` (positions 0..T-1), in its own layout."""
        raise NotImplementedError


def foreign_payload(request: FetchRequest, desc: Descriptor, prefill: PrefillFn) -> KVPayload:
    """The blocks of `request`'s prompt from `start_token` on, in `desc` (a paged layout),
    computed by `prefill` over the prompt's full blocks (not called when none are wanted)."""
    bs = desc.layout.block_size
    ids = list(request.token_ids)
    end = len(ids) // bs * bs
    first = min(request.start_token, end) // bs
    if first == end // bs:  # no full block, or the asker holds them all
        return KVPayload(first * bs, (), (), CacheBuffers.empty(desc, 0))
    native = prefill(ids[:end])  # the engine's own layout, tokens 0 .. end - 1
    paged = convert(native, desc, num_tokens=end)  # [end / bs] blocks of desc's layout
    hashes = BlockHasher(desc.model.compat_digest(), bs).hashes(ids[:end], request.cache_salt)
    tokens = tuple(ids[first * bs : end])
    return KVPayload(first * bs, tokens, tuple(hashes[first:]), blocks_from(paged, first))


def blocks_from(cache: CacheBuffers, first: int) -> CacheBuffers:
    """The paged cache's blocks `first ..` (copies; the whole cache when `first` is 0)."""
    if first == 0:
        return cache
    n = cache.extent - first
    return CacheBuffers(
        cache.desc,
        {
            s.key: cache.tensors[s.key].narrow(s.axes.index("B"), first, n).clone()
            for s in buffer_specs(cache.desc, cache.extent)
        },
    )
