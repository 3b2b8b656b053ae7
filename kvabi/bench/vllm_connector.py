"""kvabi as a vLLM KV connector: vLLM's computed blocks go through the ABI into kvabi's tiers
(disk, Redis), and matched prefixes come back instead of being recomputed.

vLLM (in `.venv-vllm`, the repo on PYTHONPATH) loads it by module path:

    kv_transfer_config={"kv_connector": "KvabiConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "kvabi.bench.vllm_connector",
                        "kv_connector_extra_config": {"model": DESCRIPTOR_JSON,
                                                      "disk_dir": DIR, "redis_url": URL}}

A block is named by its ABI block hash (vLLM's block size is the hashing block size; the
request's `cache_salt` enters the root) and
stored as a one-block container in vLLM's own layout (`vllm-cpu-*`, converted on read if a
writer used another). Only the scheduler side touches the tiers: it reads and verifies a
prompt's entries (checksums, model, block hash, tokens) before it reports a hit, so a bad or
foreign entry, or a tier that is down, is a miss and vLLM recomputes; it hands the verified
bytes to the worker, which converts them into vLLM's blocks before the forward (a synchronous
load). After the forward the worker encodes the prompt blocks the step completed and returns
them in its step output; the scheduler side writes them down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.buffers import CacheBuffers, buffer_specs
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.errors import KvabiError
from kvabi.cache.tier_config import TierConfig
from kvabi.interop.vllm_cache import kv_caches_to_buffers, read_sequence, write_sequence
from kvabi.wire import container_bytes, read_container

log = logging.getLogger(__name__)


@dataclass
class Load:
    block_ids: list[int]  # vLLM blocks to fill, one per entry
    entries: list[bytes]  # verified one-block containers, in prompt order


@dataclass
class Save:
    block_ids: list[int]  # full prompt blocks this step completes
    token_ids: list[int]  # their tokens
    block_hashes: list[bytes]


@dataclass
class KvabiMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class KvabiWorkerMetadata(KVConnectorWorkerMetadata):
    """Entries the worker encoded this step, for the scheduler side to write down."""

    entries: list[tuple[bytes, bytes]] = field(default_factory=list)  # (block hash, container)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvabiWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into kvabi metadata")
        return KvabiWorkerMetadata(self.entries + other.entries)


@dataclass
class _Request:
    """A running request as the scheduler side follows it."""

    token_ids: list[int]
    block_hashes: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    num_saved: int = 0  # leading blocks already in the tiers (loaded, or saved)


class KvabiConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.model = Descriptor.from_json(extra["model"]).model
        self.block_size = vllm_config.cache_config.block_size
        self._roots: dict[str | None, bytes] = {}  # per cache_salt
        self.tiers = []
        if role == KVConnectorRole.SCHEDULER:
            config = TierConfig(disk_dir=extra.get("disk_dir"), redis_url=extra.get("redis_url"))
            self.tiers = config.build(self.model.compat_digest())
        self._requests: dict[str, _Request] = {}
        self._matched: dict[str, list[bytes]] = {}  # entries found, waiting for blocks
        self._loads: list[Load] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._cache: CacheBuffers | None = None
        self._encoded: list[tuple[bytes, bytes]] = []

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        ids = list(request.prompt_token_ids)
        hashes = hash_blocks(ids, self.block_size, self._root(getattr(request, "cache_salt", None)))
        state = _Request(ids, hashes)
        self._requests[request.request_id] = state
        first = num_computed_tokens // self.block_size
        usable = hashes[first : (len(ids) - 1) // self.block_size]  # the last token is run
        entries = self._fetch(usable, ids, first)
        if not entries:
            return 0, False
        self._matched[request.request_id] = entries
        return first * self.block_size + len(entries) * self.block_size - num_computed_tokens, False

    def _root(self, salt: str | None) -> bytes:
        """The hash chain's root: the model's digest and the request's cache_salt (tenants
        with different salts never share a block, as in kvabi's engine)."""
        if salt not in self._roots:
            extras = {"cache_salt": salt} if salt else None
            self._roots[salt] = root_hash(self.model.compat_digest(), extras)
        return self._roots[salt]

    def _fetch(self, hashes: list[bytes], ids: list[int], first: int) -> list[bytes]:
        """The verified entries of the longest run of `hashes` that some tier holds."""
        found = []
        for i, block_hash in enumerate(hashes):
            start = (first + i) * self.block_size
            entry = self._entry(block_hash, ids[start : start + self.block_size])
            if entry is None:
                break
            found.append(entry)
        return found

    def _entry(self, block_hash: bytes, token_ids: list[int]) -> bytes | None:
        """The first tier's entry that verifies; a bad entry is removed (and recomputed)."""
        for tier in self.tiers:
            data = tier.get_many([block_hash])[0]
            if data is None:
                continue
            try:
                c = read_container(bytes(data), expect=self.model)
                if c.block_hashes != [block_hash] or list(c.token_ids) != token_ids:
                    raise KvabiError("the entry holds another block than its hash names")
            except KvabiError as exc:  # checksum, format, another model: never a load
                log.warning("kvabi: %s entry %s refused: %s", tier.name, block_hash.hex(), exc)
                tier.remove(block_hash)
                continue
            return bytes(data)
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        entries = self._matched.pop(request.request_id, [])
        if not num_external_tokens or not entries:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = request.num_computed_tokens // self.block_size
        self._loads.append(Load(block_ids[first : first + len(entries)], entries))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._loads = KvabiMetadata(loads=self._loads), []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                done = new.num_computed_tokens
                self._collect(state, done, done + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            if cached.new_block_ids[i]:
                state.block_ids += list(cached.new_block_ids[i][0])
            done = cached.num_computed_tokens[i]
            self._collect(state, done, done + scheduled[req_id], meta)
        return meta

    def _collect(self, state: _Request, done: int, after: int, meta: KvabiMetadata) -> None:
        """Queue the full prompt blocks this step completes (those before `done` exist)."""
        bs = self.block_size
        state.num_saved = max(state.num_saved, done // bs)
        end = min(after, len(state.token_ids)) // bs
        if end > state.num_saved:
            span = slice(state.num_saved, end)
            tokens = state.token_ids[state.num_saved * bs : end * bs]
            meta.saves.append(Save(state.block_ids[span], tokens, state.block_hashes[span]))
            state.num_saved = end

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvabiWorkerMetadata):
            for block_hash, entry in meta.entries:
                for tier in self.tiers:
                    tier.put(block_hash, entry)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def _vllm_cache(self, forward_context: Any) -> CacheBuffers:
        """vLLM's cache tensors as kvabi buffers, in the preset of the layers' ISA."""
        if self._cache is None:
            from vllm.model_executor.models.utils import extract_layer_index

            names = sorted(self._kv_caches, key=extract_layer_index)
            isa = forward_context.no_compile_layers[names[0]].isa
            caches = [self._kv_caches[n] for n in names]
            self._cache = kv_caches_to_buffers(caches, self.model, isa)
        return self._cache

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        cache = self._vllm_cache(forward_context)
        for load in meta.loads:
            for block_id, entry in zip(load.block_ids, load.entries, strict=True):
                src = read_container(entry, expect=self.model).cache  # verified on the way in
                write_sequence(src, cache, [block_id], self.block_size)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # whole blocks are encoded once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta, bs = self._get_connector_metadata(), self.block_size
        for save in meta.saves:
            blocks = read_sequence(self._cache, save.block_ids, len(save.block_ids) * bs)
            for i, block_hash in enumerate(save.block_hashes):
                tokens = save.token_ids[i * bs : (i + 1) * bs]
                self._encoded.append(
                    (block_hash, container_bytes(_block(blocks, i), tokens, [block_hash]))
                )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._encoded:
            return None
        meta, self._encoded = KvabiWorkerMetadata(self._encoded), []
        return meta


def _block(cache: CacheBuffers, index: int) -> CacheBuffers:
    """Block `index` of a paged cache, as a one-block cache (views)."""
    specs = buffer_specs(cache.desc, cache.extent)
    return CacheBuffers(
        cache.desc, {s.key: cache.tensors[s.key].narrow(s.dim("B"), index, 1) for s in specs}
    )
