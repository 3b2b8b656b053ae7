"""`PromptHashing`: how the router hashes a request's prompt to match its instances' KV events,
by the block-hash scheme those instances use (kvabi/abi/hash_schemes.py, `--hash-scheme`).

kvabi instances (scheme `kvabi`) give the root with the token ids (`hash_root`: the model's
digest and the cache salt). A peer's root does not depend on the instance: vLLM's NONE_HASH
from its seed (PYTHONHASHSEED; unset: "vllm-none-hash"), llm-d's FNV root from its seed and
the model name, SGLang's none. vLLM hashes a request's `cache_salt` as an extra key of its
first block (`generate_block_hash_extra_keys`); so do the schemes that reuse its chain.
The hashes are the keys the events carry (`HashScheme.event_key`): the whole hash, or the
64 bits llm-d (and vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) publish, which the event
decoder turns into 8 bytes big-endian.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvabi.abi.hash_schemes import HashScheme, RootInputs, get_scheme


@dataclass(frozen=True)
class PromptHashing:
    scheme_name: str = "kvabi"
    seed: str | None = None  # the peer's hash seed (None: the scheme's default)
    model_name: str = ""  # llm-d FNV roots on the model name its indexer is given

    def __post_init__(self) -> None:
        get_scheme(self.scheme_name)  # HashSchemeError for an unknown name

    @property
    def scheme(self) -> HashScheme:
        return get_scheme(self.scheme_name)

    @property
    def takes_salt(self) -> bool:
        """Whether a request's cache salt enters its hashes here (the instance's root holds
        it for kvabi's own scheme)."""
        return self.scheme.salt_in_first_block

    def hashes(
        self,
        token_ids: Sequence[int],
        block_sizes: Iterable[int],
        instance_root: bytes,
        cache_salt: str | None = None,
    ) -> dict[int, list[bytes]]:
        """The prompt's event keys for each block size."""
        scheme = self.scheme
        if scheme.name == "kvabi":
            root = instance_root
        else:
            root = scheme.root(RootInputs(seed=self.seed, model_name=self.model_name))
        out = {}
        for size in block_sizes:
            extras = self._extra_keys(len(token_ids) // size, cache_salt)
            chain = scheme.hash_blocks(token_ids, size, root, extras)
            out[size] = [scheme.event_key(h) for h in chain]
        return out

    def _extra_keys(self, num_blocks: int, cache_salt: str | None) -> list[Any] | None:
        if not cache_salt or not self.takes_salt or not num_blocks:
            return None
        return [(("cache_salt", cache_salt),)] + [None] * (num_blocks - 1)
