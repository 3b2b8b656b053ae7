"""Engine adapters: HF transformers' DynamicCache and llama.cpp's state bytes <-> kvabi buffers.

- model_spec.py: a `ModelSpec` from an HF config or a GGUF file (geometry, RoPE pairing,
  fingerprint).
- hf_cache.py: `DynamicCache` <-> `hf-dynamic` buffers; the forward's cache keyword.
- llamacpp_state.py: parse and write llama.cpp's state byte grammar (seq v3/v2, full state).
- llamacpp_model.py: parsed states <-> `llamacpp-*` buffers, in a target context's format.
- llamacpp_context.py: a live llama-cpp-python `Llama`: get/set a seq's state, restore.

transformers and llama-cpp-python are imported lazily, by the functions that need them.
"""

from kvabi.interop.errors import (
    InteropError,
    ModelMismatchError,
    StateFormatError,
    StateMagicError,
    StateTruncatedError,
    UnsupportedTypeError,
)
from kvabi.interop.hf_cache import (
    buffers_to_dynamic_cache,
    cache_kwarg,
    dynamic_cache_to_buffers,
    forward_with_cache,
    output_cache,
)
from kvabi.interop.llamacpp_context import (
    cache_format,
    get_seq_state,
    greedy_tokens,
    last_logits,
    restore_sequence,
    set_seq_state,
)
from kvabi.interop.llamacpp_model import (
    LlamaCacheFormat,
    buffers_to_state,
    llamacpp_descriptor,
    state_to_buffers,
)
from kvabi.interop.llamacpp_state import (
    Cell,
    KvStream,
    LlamaState,
    StateTensor,
    parse_state,
    write_state,
)
from kvabi.interop.model_spec import (
    gguf_fingerprint,
    model_spec_from_gguf,
    model_spec_from_gguf_metadata,
    model_spec_from_hf_config,
    model_spec_from_llama,
    state_dict_fingerprint,
)

__all__ = [
    "Cell",
    "InteropError",
    "KvStream",
    "LlamaCacheFormat",
    "LlamaState",
    "ModelMismatchError",
    "StateFormatError",
    "StateMagicError",
    "StateTensor",
    "StateTruncatedError",
    "UnsupportedTypeError",
    "buffers_to_dynamic_cache",
    "buffers_to_state",
    "cache_format",
    "cache_kwarg",
    "dynamic_cache_to_buffers",
    "forward_with_cache",
    "get_seq_state",
    "gguf_fingerprint",
    "greedy_tokens",
    "last_logits",
    "llamacpp_descriptor",
    "model_spec_from_gguf",
    "model_spec_from_gguf_metadata",
    "model_spec_from_hf_config",
    "model_spec_from_llama",
    "output_cache",
    "parse_state",
    "restore_sequence",
    "set_seq_state",
    "state_dict_fingerprint",
    "state_to_buffers",
    "write_state",
]
