"""Peers' block-hash chains, byte for byte: one step (parent, one block's token ids, extra
keys) -> the block's hash, and each peer's root. Definitions and sources: docs/ABI.md section
4.3 ("Peers' hash schemes"); the registry that names them is `hash_schemes.py`.

- vLLM 0.32 (`vllm/v1/core/kv_cache_utils.py` `hash_block_tokens`, `vllm/utils/hashing.py`):
  h = H((parent, tuple(tokens), extra_keys)) with H = SHA-256 over canonical CBOR
  (`sha256_cbor`) or over pickle protocol 5 (`sha256`); the root NONE_HASH = H(seed), seed
  "vllm-none-hash" unless PYTHONHASHSEED is set.
- llm-d kv-cache (`pkg/kvcache/kvblock/token_processor.go`): FNV-64a over canonical CBOR
  [parent_u64, tokens, extra], root FNV-64a(CBOR([FNV-64a(seed), null, model_name])).
- SGLang (`python/sglang/srt/mem_cache/hicache_storage.py` `get_hash_str`): SHA-256 over the
  parent's 32 bytes (none for the first page) then each token id as u32 little-endian.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from kvabi.abi import cbor
from kvabi.abi.errors import CodecError, HashSchemeError

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED
FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_U64 = 2**64 - 1


def fnv64a(data: bytes) -> int:
    """FNV-1a, 64 bits (Go's hash/fnv New64a)."""
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _U64
    return h


def vllm_cbor_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """vLLM's `hash_block_tokens(sha256_cbor, parent, tokens, extra_keys)`."""
    return hashlib.sha256(_cbor((parent, tuple(token_ids), extra_keys))).digest()


def vllm_cbor_root(seed: str = VLLM_DEFAULT_SEED) -> bytes:
    """vLLM's NONE_HASH under `sha256_cbor`: SHA-256(CBOR(seed))."""
    return hashlib.sha256(_cbor(seed)).digest()


def vllm_pickle_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """vLLM's `hash_block_tokens(sha256, ...)`: SHA-256 of pickle protocol 5 of the tuple.
    Only pickling (never unpickling) of plain values; extra keys must be None or a tuple of
    tuples of str/bytes/int (pickle's memo would make repeated str objects depend on identity)."""
    _check_plain(extra_keys)
    payload = (bytes(parent), tuple(int(t) for t in token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def vllm_pickle_root(seed: str = VLLM_DEFAULT_SEED) -> bytes:
    """vLLM's NONE_HASH under `sha256`: SHA-256(pickle(seed))."""
    return hashlib.sha256(pickle.dumps(seed, protocol=5)).digest()


def llmd_fnv_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """llm-d's FNV-64a step; hashes are the u64 as 8 bytes big-endian."""
    value = fnv64a(_cbor([int.from_bytes(parent, "big"), list(token_ids), extra_keys]))
    return value.to_bytes(8, "big")


def llmd_fnv_root(seed: str = "", model_name: str = "") -> bytes:
    """llm-d's FNV-64a root for `model_name` (its `getInitHash`): the model name is the
    extra of a step with no tokens (Go's nil slice, CBOR null) from FNV-64a(seed)."""
    init = fnv64a(seed.encode("utf-8"))
    return fnv64a(_cbor([init, None, model_name])).to_bytes(8, "big")


def sglang_block(parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
    """SGLang's `get_hash_str` (as bytes, not hex); it has no extra keys."""
    if extra_keys is not None:
        raise HashSchemeError("sglang-sha256: SGLang's page hash has no extra keys")
    hasher = hashlib.sha256(parent)  # the empty root: no prior hash
    for t in token_ids:
        hasher.update(int(t).to_bytes(4, "little"))
    return hasher.digest()


def _cbor(value: Any) -> bytes:
    try:
        return cbor.dumps(value)
    except CodecError as exc:
        raise HashSchemeError(f"extra keys: {exc}") from exc


def _check_plain(extra_keys: Any) -> None:
    if extra_keys is None:
        return
    ok = isinstance(extra_keys, tuple) and all(
        isinstance(k, tuple) and all(isinstance(v, str | bytes | int) for v in k)
        for k in extra_keys
    )
    if not ok:
        raise HashSchemeError(
            f"vllm-sha256: extra keys must be tuples of plain values, got {extra_keys!r:.80}"
        )
