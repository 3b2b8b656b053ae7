"""`LlamaCppPrefillProvider`: llama.cpp (llama-cpp-python) as a prefill instance for kvabi
decode instances.

llama.cpp evaluates the prompt's full blocks in its own kernels; its sequence state bytes
(`llama_state_seq_get_data`) are read through the llama.cpp adapter (`kvabi.interop.
llamacpp_model.state_to_buffers`, presets `llamacpp-*`) into ABI buffers, then re-blocked,
hashed and sliced as every foreign engine's (`foreign_prefill.py`).

The descriptor it publishes is llama.cpp's own cache: its K/V dtype (f16 by default) and K's
rotary dims in llama.cpp's `pairs` order (`model_spec_from_llama`). The decode side converts
both on receipt, as for any peer whose layout differs. The fingerprint must name the same
weights as the decode instance's: for a GGUF, `gguf_fingerprint` of the file both load.
"""

from __future__ import annotations

from typing import Any

from kvabi.abi.buffers import CacheBuffers
from kvabi.interop.errors import UnsupportedTypeError
from kvabi.interop.foreign_prefill import ForeignPrefillProvider
from kvabi.interop.llamacpp_context import cache_format, get_seq_state
from kvabi.interop.llamacpp_model import GGML_TYPE_NAMES, state_to_buffers
from kvabi.interop.model_spec import model_spec_from_llama

FLOAT_TYPES = ("f32", "f16", "bf16")  # K/V types a paged kvabi layout holds unquantised


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
