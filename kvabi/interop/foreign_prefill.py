"""Foreign engines as prefill instances: `HFPrefillProvider` (HF transformers) and
`LlamaCppPrefillProvider` (llama-cpp-python), over what both share (`ForeignPrefillProvider`).

An engine that is not kvabi computes the KV of a prompt's full blocks in its own layout,
positions 0..T-1 of one sequence (a subclass's `prefill`: HF's forward and its `DynamicCache`
through `hf_cache.py`, preset `hf-dynamic`; llama.cpp's eval and its sequence state bytes
through `llamacpp_model.py`, presets `llamacpp-*`). `foreign_payload` does the rest, the same
for every engine: re-blocks that cache into the instance's paged descriptor by the one
conversion path, hashes the blocks as a kvabi instance does (`BlockHasher`), and keeps the
blocks from `start_token` on. The partial last block is neither computed nor sent: the decode
side computes those few tokens itself. The decode side cannot tell such a peer from a kvabi
prefill instance: same handshake, same container, same checks.

The fingerprint must name the same weights as the decode instance's (equal fingerprints mean
equal weights, docs/ABI.md): for a GGUF, `gguf_fingerprint` of the file both load. llama.cpp's
descriptor is its own cache: its K/V dtype (f16 by default) and K's rotary dims in its `pairs`
order (`model_spec_from_llama`); the decode side converts both on receipt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_hasher import BlockHasher
from kvabi.cache.kv_cache import FetchRequest, KVPayload
from kvabi.interop.errors import UnsupportedTypeError
from kvabi.interop.hf_cache import FLOAT_DTYPES, dynamic_cache_to_buffers
from kvabi.interop.llamacpp_context import cache_format, get_seq_state
from kvabi.interop.llamacpp_model import GGML_TYPE_NAMES, state_to_buffers
from kvabi.interop.model_spec import model_spec_from_hf_config, model_spec_from_llama

PrefillFn = Callable[[list[int]], CacheBuffers]  # token ids -> their KV, any layout
FLOAT_TYPES = ("f32", "f16", "bf16")  # K/V types a paged kvabi layout holds unquantised


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


class LlamaCppPrefillProvider(ForeignPrefillProvider):
    """A `KVProvider` over a `llama_cpp.Llama` (one prompt at a time, in its seq 0)."""

    def __init__(
        self, llm: Any, fingerprint: str, block_size: int = 16, layout: str = "vllm-flash-attn"
    ) -> None:
        self.llm = llm
        fmt = cache_format(llm)
        dtype = GGML_TYPE_NAMES.get(fmt.type_k, str(fmt.type_k))
        if dtype not in FLOAT_TYPES or fmt.type_v != fmt.type_k:
            raise UnsupportedTypeError(
                f"llama.cpp K/V types {fmt.type_k}/{fmt.type_v}: a prefill worker sends "
                f"unquantised K/V of one type, one of {FLOAT_TYPES}"
            )
        super().__init__(model_spec_from_llama(llm, fingerprint), dtype, block_size, layout)

    def prefill(self, token_ids: list[int]) -> CacheBuffers:
        """llama.cpp's eval of `token_ids` from an empty seq 0; its state as `llamacpp-*`."""
        self.llm.reset()  # the next eval drops whatever seq 0 held
        self.llm.eval(token_ids)
        return state_to_buffers(get_seq_state(self.llm), self.spec)  # positions 0..T-1
