"""A live llama-cpp-python `Llama`: its cache format, its seq state, and restoring a sequence.

llama-cpp-python (0.3.36) is imported lazily; `llm` is a `llama_cpp.Llama`. A state carries no
logits (v10), so a restored sequence re-decodes its last token before sampling: `restore_sequence`
writes the KV of all tokens but the last and evaluates that one.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import ModelSpec
from kvabi.interop.errors import InteropError
from kvabi.interop.llamacpp_model import LlamaCacheFormat, buffers_to_state

FLASH_ATTN_DISABLED = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED: the only setting that transposes V


def cache_format(llm: Any) -> LlamaCacheFormat:
    """The format `llm`'s KV state has (and a state set into it must have)."""
    p = llm.context_params
    n_stream = 1 if p.kv_unified else max(int(p.n_seq_max), 1)
    v_trans = p.flash_attn_type == FLASH_ATTN_DISABLED
    return LlamaCacheFormat(int(p.type_k), int(p.type_v), v_trans, n_stream)


def get_seq_state(llm: Any, seq_id: int = 0) -> bytes:
    """`llama_state_seq_get_data` of `seq_id` (a seq-v3 buffer)."""
    import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(llm.ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, seq_id)
    return bytes(buf[:written])


def set_seq_state(llm: Any, data: bytes, seq_id: int = 0) -> None:
    """`llama_state_seq_set_data` into `seq_id`; raises InteropError if llama.cpp refuses it."""
    import llama_cpp

    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    read = llama_cpp.llama_state_seq_set_data(llm.ctx, buf, len(data), seq_id)
    if read != len(data):
        raise InteropError(
            f"llama.cpp refused the state ({read} of {len(data)} bytes read): its n_layer, "
            "types, v_trans or sizes differ from the context's"
        )


def restore_sequence(
    llm: Any, cache: CacheBuffers, model: ModelSpec, token_ids: Sequence[int],
    block_ids: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Make `llm` hold `token_ids` (seq 0) from a kvabi cache, ready to sample the next token.

    The cache (any layout) must hold at least the first len(token_ids) - 1 tokens; `model` is
    llama.cpp's side (`model_spec_from_gguf` / `model_spec_from_llama`). Replaces what `llm`
    held; its KV for all but the last token comes from `cache`, the last token is decoded.
    A sliding-window model's cache must hold the window of position len(token_ids) - 1: a
    cache exported after all of `token_ids` does not (sliding.py), and is refused.
    """
    if not token_ids:
        raise InteropError("restoring needs at least one token (the one to decode)")
    num_cached = len(token_ids) - 1
    llm.reset()
    if num_cached:
        data = buffers_to_state(
            cache, model, cache_format(llm), num_tokens=num_cached, block_ids=block_ids
        )
        set_seq_state(llm, data)
    llm.n_tokens = num_cached
    llm.input_ids[:num_cached] = token_ids[:num_cached]
    llm.eval(list(token_ids[num_cached:]))


def last_logits(llm: Any) -> np.ndarray:
    """The logits of the last decoded token, float32 [n_vocab] (a copy)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def greedy_tokens(llm: Any, num_tokens: int) -> list[int]:
    """Sample `num_tokens` greedily (argmax, lowest id on ties) from `llm`'s current state."""
    out = []
    for _ in range(num_tokens):
        out.append(int(np.argmax(last_logits(llm))))
        llm.eval(out[-1:])
    return out
