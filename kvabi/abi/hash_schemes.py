"""Named, selectable block-hash schemes: kvabi's own (docs/ABI.md section 4) and its peers'
(section 4.3), so kvabi can compute the block hashes a vLLM, llm-d or SGLang deployment uses,
e.g. to index their KV events (`kvabi router --hash-scheme NAME`).

A scheme is a chain step (parent, the token ids of one full block, extra keys) -> the block's
hash, a root rule (where a chain starts, from a `RootInputs`), and the key its events carry for
a hash (`event_key`: the whole hash, or the 64 bits a peer publishes). `get_scheme(name)` looks
one up; an unknown name, a token id outside [0, 2^32), a parent of the wrong length or extra
keys a scheme cannot encode raise `HashSchemeError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvabi.abi import block_hash as kvabi_hash
from kvabi.abi import peer_block_hashes as peers
from kvabi.abi.errors import HashSchemeError

Step = Callable[[bytes, Sequence[int], Any], bytes]


@dataclass(frozen=True)
class RootInputs:
    """What roots a chain; each scheme reads the fields it needs (section 4.3)."""

    seed: str | None = None  # vLLM / llm-d hash seed (None: the scheme's default)
    model_name: str = ""  # llm-d FNV roots on it
    compat_digest: str | None = None  # kvabi roots on it
    cache_salt: str | None = None  # kvabi roots on it (vLLM: an extra key of block 0)


@dataclass(frozen=True)
class HashScheme:
    name: str
    hash_bytes: int  # length of every hash of the chain (and of its root)
    key_bytes: int  # length of `event_key`
    step: Step
    root_rule: Callable[[RootInputs], bytes]
    key_from_end: bool = True  # event key: the last `key_bytes` bytes (else the first)
    empty_root: bool = False  # the root is b"" (no parent), as SGLang's first page has
    salt_in_first_block: bool = False  # a cache salt is block 0's extra key (vLLM's chain)
    summary: str = ""

    def root(self, inputs: RootInputs = RootInputs()) -> bytes:
        """Where this scheme's chains start, for `inputs`."""
        return self.root_rule(inputs)

    def hash_block(self, parent: bytes, token_ids: Sequence[int], extra_keys: Any = None) -> bytes:
        """One step of the chain; `parent` is the root or the previous block's hash."""
        self._check_parent(parent, allow_empty=self.empty_root)
        tokens = _tokens(token_ids)
        return self.step(bytes(parent), tokens, extra_keys)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        root: bytes,
        extra_keys: Sequence[Any] | None = None,
    ) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids` (a partial block has none);
        `extra_keys`, when given, has one entry (or None) per full block."""
        if block_size < 1:
            raise HashSchemeError(f"block_size must be >= 1, got {block_size}")
        tokens = _tokens(token_ids)
        num_blocks = len(tokens) // block_size
        if extra_keys is not None and len(extra_keys) != num_blocks:
            raise HashSchemeError(f"extra_keys: {len(extra_keys)} entries for {num_blocks} blocks")
        self._check_parent(root, "root", allow_empty=self.empty_root)
        hashes, parent = [], bytes(root)
        for i in range(num_blocks):
            block = tokens[i * block_size : (i + 1) * block_size]
            parent = self.step(parent, block, None if extra_keys is None else extra_keys[i])
            hashes.append(parent)
        return hashes

    def event_key(self, block_hash: bytes) -> bytes:
        """The key a peer's KV events carry for `block_hash`."""
        self._check_parent(block_hash, "block_hash")
        if self.key_from_end:
            return bytes(block_hash[len(block_hash) - self.key_bytes :])
        return bytes(block_hash[: self.key_bytes])

    def _check_parent(self, parent: bytes, name: str = "parent", allow_empty: bool = False) -> None:
        sizes = (self.hash_bytes, 0) if allow_empty else (self.hash_bytes,)
        if not isinstance(parent, bytes | bytearray) or len(parent) not in sizes:
            raise HashSchemeError(
                f"{self.name}: {name} must be {self.hash_bytes} bytes, got {parent!r:.80}"
            )


def _tokens(token_ids: Sequence[int]) -> list[int]:
    for i, t in enumerate(token_ids):  # numpy would read "7" as 7 and 1.5 as 1
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise HashSchemeError(f"token_ids: {t!r} at index {i} is not an integer")
    try:
        return kvabi_hash.token_array(token_ids).tolist()
    except ValueError as exc:
        raise HashSchemeError(str(exc)) from exc


def _kvabi_step(parent: bytes, token_ids: Sequence[int], extra_keys: Any) -> bytes:
    if extra_keys is not None:
        raise HashSchemeError("kvabi: extra keys enter the root (RootInputs), not a block")
    return kvabi_hash.hash_block(parent, token_ids)


def _kvabi_root(inputs: RootInputs) -> bytes:
    if inputs.compat_digest is None:
        raise HashSchemeError("kvabi: the root needs the model's compat_digest")
    try:
        return kvabi_hash.request_root(inputs.compat_digest, inputs.cache_salt)
    except ValueError as exc:
        raise HashSchemeError(str(exc)) from exc


def _seed(inputs: RootInputs, default: str) -> str:
    return default if inputs.seed is None else inputs.seed


SCHEMES: dict[str, HashScheme] = {
    s.name: s
    for s in (
        HashScheme("kvabi", 32, 32, _kvabi_step, _kvabi_root, summary="docs/ABI.md 4.1-4.2"),
        HashScheme(
            "vllm-sha256-cbor",
            32,
            32,
            peers.vllm_cbor_block,
            lambda i: peers.vllm_cbor_root(_seed(i, peers.VLLM_DEFAULT_SEED)),
            salt_in_first_block=True,
            summary="vLLM --prefix-caching-hash-algo sha256_cbor",
        ),
        HashScheme(
            "vllm-sha256",
            32,
            32,
            peers.vllm_pickle_block,
            lambda i: peers.vllm_pickle_root(_seed(i, peers.VLLM_DEFAULT_SEED)),
            salt_in_first_block=True,
            summary="vLLM --prefix-caching-hash-algo sha256 (pickle)",
        ),
        HashScheme(
            "llm-d-fnv64a",
            8,
            8,
            peers.llmd_fnv_block,
            lambda i: peers.llmd_fnv_root(_seed(i, ""), i.model_name),
            summary="llm-d kv-cache default (fnv64a_cbor)",
        ),
        HashScheme(
            "llm-d-sha256-cbor-64",
            32,
            8,
            peers.vllm_cbor_block,
            lambda i: peers.vllm_cbor_root(_seed(i, "")),
            salt_in_first_block=True,
            summary="llm-d sha256_cbor: vLLM's chain, keys the last 8 bytes (big-endian u64)",
        ),
        HashScheme(
            "sglang-sha256",
            32,
            32,
            peers.sglang_block,
            lambda i: b"",
            empty_root=True,
            summary="SGLang HiCache page keys (get_hash_str)",
        ),
    )
}


def get_scheme(name: str) -> HashScheme:
    """The scheme called `name` (see `SCHEMES`); HashSchemeError for any other name."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise HashSchemeError(
            f"unknown block-hash scheme {name!r}; known: {', '.join(SCHEMES)}"
        ) from None
