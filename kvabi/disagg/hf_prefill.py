"""`HFPrefillProvider`: HF transformers as a prefill instance for kvabi decode instances.

A foreign engine on the prefill side: HF's own forward over the prompt's full blocks, its
`DynamicCache` read through the ABI adapter (`kvabi.interop.hf_cache`, preset `hf-dynamic`),
re-blocked into a paged preset by the one conversion path, hashed with the portable block
hash, and handed to any transport as a `KVPayload`. The decode side cannot tell it from a
kvabi prefill instance: same handshake, same container, same checks.

The fingerprint must name the same weights as the decode instance's (equal fingerprints mean
equal weights, docs/ABI.md): pass the one the deployment uses for this model.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.presets import preset_descriptor
from kvabi.disagg.transport import FetchRequest, KVPayload
from kvabi.interop.hf_cache import FLOAT_DTYPES, dynamic_cache_to_buffers
from kvabi.interop.model_spec import model_spec_from_hf_config


class HFPrefillProvider:
    """A `KVProvider` over an HF causal LM (one prompt at a time)."""

    def __init__(
        self, model: Any, fingerprint: str, block_size: int = 16, layout: str = "vllm-flash-attn"
    ) -> None:
        self.model = model.eval()
        self.spec = model_spec_from_hf_config(model.config, fingerprint)
        dtype = FLOAT_DTYPES[next(model.parameters()).dtype]
        self.desc: Descriptor = preset_descriptor(
            layout, self.spec, block_size=block_size, dtype=dtype
        )
        self._lock = threading.Lock()

    def __call__(self, request: FetchRequest) -> KVPayload:
        """Prefill the prompt's full blocks with HF; return those from `start_token` on."""
        bs = self.desc.layout.block_size
        ids = request.token_ids
        end = len(ids) // bs * bs  # the decode side computes the partial last block
        first = min(request.start_token, end) // bs
        if end == 0 or first == end // bs:
            return KVPayload(first * bs, (), (), CacheBuffers.empty(self.desc, 0))
        with self._lock, torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids[:end]]), use_cache=True)
        hf = dynamic_cache_to_buffers(out.past_key_values, self.spec)  # [H, T, D] per plane
        paged = convert(hf, self.desc, num_tokens=end)  # [end / bs] blocks of this layout
        salt = None if request.cache_salt is None else {"cache_salt": request.cache_salt}
        hashes = hash_blocks(ids[:end], bs, root_hash(self.spec.compat_digest(), salt))
        cache = _blocks_from(paged, first)
        return KVPayload(first * bs, tuple(ids[first * bs : end]), tuple(hashes[first:]), cache)


def _blocks_from(cache: CacheBuffers, first: int) -> CacheBuffers:
    """The cache's blocks `first ..` (copies)."""
    n = cache.extent - first
    return CacheBuffers(
        cache.desc,
        {
            s.key: cache.tensors[s.key].narrow(s.axes.index("B"), first, n).clone()
            for s in buffer_specs(cache.desc, cache.extent)
        },
    )
