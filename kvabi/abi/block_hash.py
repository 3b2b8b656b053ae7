"""Portable chained block hashes: the identity of a block of tokens in a given model's cache.

A chain starts at a root that binds the model (its compat digest) and any extra keys (cache
salt, adapter); block i's hash covers its parent's hash and its own token ids, so equal hashes
mean an equal prefix of tokens under the same root. Byte-exact definition: docs/ABI.md, section 4.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence

import numpy as np

ROOT_TAG = b"kvabi-block-hash/1"
HASH_BYTES = 32
COMPAT_DIGEST_BYTES = 16
TOKEN_ID_LIMIT = 2**32  # token ids are stored as u32
_U16_LIMIT = 2**16


def root_hash(compat_digest: str, extra_keys: Mapping[str, str] | None = None) -> bytes:
    """The chain's root: SHA-256 over the tag, the 16-byte compat digest and the extra keys.

    `compat_digest` is `ModelSpec.compat_digest()` (32 hex chars). `extra_keys` (e.g.
    `{"cache_salt": "tenant-a"}`) enter the root, so every hash of the chain depends on them.
    """
    digest = _digest_bytes(compat_digest)
    return hashlib.sha256(ROOT_TAG + digest + _extras_bytes(extra_keys or {})).digest()


def request_root(compat_digest: str, cache_salt: str | None = None) -> bytes:
    """The root of a request's chain: the model's digest and, when given, its `cache_salt`
    (tenants with different salts never share a block). The one rule every producer of
    kvabi block hashes follows; an empty salt is refused, not read as "no salt"."""
    if cache_salt is None:
        return root_hash(compat_digest)
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt: must be a non-empty string or None, got {cache_salt!r}")
    return root_hash(compat_digest, {"cache_salt": cache_salt})


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one block: SHA-256(parent || u32 LE count || each token id as u32 LE)."""
    _check_parent(parent)
    tokens = token_array(token_ids)
    return hashlib.sha256(parent + struct.pack("<I", len(tokens)) + tokens.tobytes()).digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_parent(root, "root")
    data = token_array(token_ids).tobytes()  # [num_tokens * 4] bytes, u32 LE each
    count = struct.pack("<I", block_size)
    step = 4 * block_size
    hashes, parent = [], root
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + count + data[start : start + step]).digest()
        hashes.append(parent)
    return hashes


def token_array(token_ids: Sequence[int], name: str = "token_ids") -> np.ndarray:
    """Token ids as a little-endian u32 array; ids outside [0, 2^32) raise ValueError."""
    try:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # [num_tokens]
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be integers in [0, 2^32): {exc}") from exc
    bad = (ids < 0) | (ids >= TOKEN_ID_LIMIT)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: id {int(ids[index])} at index {index} is outside [0, 2^32)")
    return ids.astype("<u4")


def _digest_bytes(compat_digest: str) -> bytes:
    if not isinstance(compat_digest, str) or len(compat_digest) != 2 * COMPAT_DIGEST_BYTES:
        raise ValueError(f"compat_digest: expected 32 hex chars, got {compat_digest!r}")
    try:
        return bytes.fromhex(compat_digest)
    except ValueError as exc:
        raise ValueError(f"compat_digest: not hex: {compat_digest!r}") from exc


def _extras_bytes(extra_keys: Mapping[str, str]) -> bytes:
    for key, value in extra_keys.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"extra_keys: keys and values must be str, got {key!r}: {value!r}")
    parts = [struct.pack("<I", len(extra_keys))]
    for key in sorted(extra_keys):  # code point order == UTF-8 byte order
        k, v = key.encode(), extra_keys[key].encode()
        if len(k) >= _U16_LIMIT or len(v) >= TOKEN_ID_LIMIT:
            raise ValueError(f"extra_keys: key {key[:40]!r} or its value is too long")
        parts += [struct.pack("<H", len(k)), k, struct.pack("<I", len(v)), v]
    return b"".join(parts)


def _check_parent(parent: bytes, name: str = "parent") -> None:
    if not isinstance(parent, bytes | bytearray) or len(parent) != HASH_BYTES:
        raise ValueError(f"{name}: expected a {HASH_BYTES}-byte hash, got {parent!r:.80}")
