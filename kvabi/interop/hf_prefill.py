"""`HFPrefillProvider`: HF transformers as a prefill instance for kvabi decode instances.

A foreign engine on the prefill side: HF's own forward over the prompt's full blocks, its
`DynamicCache` read through the ABI adapter (`kvabi.interop.hf_cache`, preset `hf-dynamic`),
then re-blocked, hashed and sliced as every foreign engine's (`foreign_prefill.py`). The decode
side cannot tell it from a kvabi prefill instance: same handshake, same container, same checks.

The fingerprint must name the same weights as the decode instance's (equal fingerprints mean
equal weights, docs/ABI.md): pass the one the deployment uses for this model.
"""

from __future__ import annotations

from typing import Any

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.interop.foreign_prefill import ForeignPrefillProvider
from kvabi.interop.hf_cache import FLOAT_DTYPES, dynamic_cache_to_buffers
from kvabi.interop.model_spec import model_spec_from_hf_config


class HFPrefillProvider(ForeignPrefillProvider):
    """A `KVProvider` over an HF causal LM (one prompt at a time)."""

    def __init__(
        self, model: Any, fingerprint: str, block_size: int = 16, layout: str = "vllm-flash-attn"
    ) -> None:
        self.model = model.eval()
        spec = model_spec_from_hf_config(model.config, fingerprint)
        dtype = FLOAT_DTYPES[next(model.parameters()).dtype]
        super().__init__(spec, dtype, block_size, layout)

    def prefill(self, token_ids: list[int]) -> CacheBuffers:
        """HF's forward over `token_ids`; its cache as `hf-dynamic` buffers."""
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([token_ids]), use_cache=True)
        return dynamic_cache_to_buffers(out.past_key_values, self.spec)  # [H, T, D] per plane
