"""kvabi as a vLLM KV connector: vLLM's computed blocks go through the ABI into kvabi's tiers
(disk, Redis), and matched prefixes come back instead of being recomputed.

vLLM (in `.venv-vllm`, the repo on PYTHONPATH) loads it by module path:

    kv_transfer_config={"kv_connector": "KvabiConnector", "kv_role": "kv_both",
                        "kv_connector_module_path": "kvabi.connectors.vllm_connector",
                        "kv_connector_extra_config": {"store": DESCRIPTOR_JSON,
                                                      "disk_dir": DIR, "redis_url": URL}}

The store descriptor names the model and the layout and block size of the entries: one-block
containers keyed by their ABI block hash, exactly what kvabi's engine keeps in the same tiers
(with kvabi's engine descriptor, the two engines share one store). vLLM's block size must be a
multiple of the store's (128 = 8 x 16); otherwise the connector refuses to start. One vLLM
block is then `ratio` store blocks; the request's `cache_salt` enters the hash chain's root.
Only the scheduler side touches the tiers: it reads and verifies a prompt's entries (checksums,
model, block hash, tokens) before it reports a hit, so a bad or foreign entry, or a tier that
is down, is a miss and vLLM recomputes. While other requests are in flight, the reads run off
vLLM's scheduling loop (`async_fetch`, on by default): asked about a prompt whose first block
some tier holds, the connector starts a fetch on its own thread and answers "not known yet"
(vLLM's `None`), so vLLM keeps stepping the others, and answers with the verified count once
the fetch is done; a prompt whose first block no tier holds is a miss at once. With no other
request in flight the fetch runs in place: there is nothing to overlap it with, and vLLM's
engine loop, polling meanwhile, would only slow the fetch's thread down (measured: a
2,560-token hit's TTFT 580 ms polled against 101 ms in place, on 2 cores). It hands the
verified blocks to the worker (in the connector metadata), which converts them into vLLM's
blocks (preset `vllm-cpu-*` of the layers' ISA) on its load thread, four layers at a time,
while the forward runs: each attention layer waits only for its own layer's blocks
(`LayerLoads`). That is the default where a core is spare for the thread (`async_load`:
"auto"; true, false); elsewhere they are all placed before the forward.
After the forward the worker converts the prompt blocks the step completed into the store's
layout and returns the entries in its step output; the scheduler side queues them for its
writer thread (`TierWriter`: bounded, what does not fit is dropped and counted), so vLLM's loop
never waits on a disk or Redis; a later prompt that needs blocks still queued waits for them.
"""

from __future__ import annotations

import atexit
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.descriptor import Descriptor
from kvabi.cache.block_codec import BlockCodec, narrow_blocks
from kvabi.cache.block_hasher import BlockHasher, BlockKey
from kvabi.cache.tier_config import TierConfig
from kvabi.cache.tier_writer import TierWriter
from kvabi.cache.tiered_cache import TieredCache
from kvabi.connectors.layer_loads import LayerLoads, Load, spare_cores
from kvabi.interop.vllm_cache import (
    check_block_ids,
    kv_caches_to_buffers,
    store_ratio,
)
from kvabi.native.cpu_kernels import cpu_kernels
from kvabi.wire.entries import entry_shape

log = logging.getLogger(__name__)


@dataclass
class Save:
    block_ids: list[int]  # full prompt blocks (vLLM's) this step completes
    keys: list[BlockKey]  # their store blocks (`ratio` per vLLM block)


@dataclass
class KvabiMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class KvabiWorkerMetadata(KVConnectorWorkerMetadata):
    """Entries the worker encoded this step, for the scheduler side to write down."""

    # (block hash, container): each a view of its row of the step's encoded entries (an array
    # pickles where vLLM sends this between processes; a memoryview would not)
    entries: list[tuple[bytes, np.ndarray]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvabiWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into kvabi metadata")
        return KvabiWorkerMetadata(self.entries + other.entries)


@dataclass
class TransferStats:
    """The connector's work. Scheduler side: entries fetched from the tiers and verified, and
    written down. Worker side: store blocks placed into / read out of vLLM's cache."""

    num_fetched: int = 0
    fetch_s: float = 0.0  # tier reads + verification
    num_background_fetches: int = 0  # fetches run off vLLM's scheduling loop
    num_not_yet: int = 0  # times vLLM was told "not known yet" while one ran
    write_s: float = 0.0  # queueing entries for the writer thread
    num_write_dropped: int = 0  # entries the writer's queue had no room for
    num_loaded: int = 0
    num_saved: int = 0
    bytes_loaded: int = 0  # K/V payload bytes
    bytes_saved: int = 0
    load_s: float = 0.0  # convert into vLLM's blocks (on the load thread)
    load_wait_s: float = 0.0  # the forwards' time waiting for a layer's blocks
    save_s: float = 0.0  # convert out of vLLM's blocks + encode


@dataclass
class _Fetch:
    """A prompt's fetch running on the connector's thread, from vLLM block `first` on."""

    first: int
    future: Future


@dataclass
class _Request:
    """A running request as the scheduler side follows it."""

    token_ids: list[int]
    keys: list[BlockKey]  # the prompt's full store blocks
    block_ids: list[int] = field(default_factory=list)  # vLLM's
    num_saved: int = 0  # leading vLLM blocks already in the tiers (loaded, or saved)


class KvabiConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.store = Descriptor.from_json(extra["store"])
        self.model, self.codec = self.store.model, BlockCodec(self.store)
        self.block_size = vllm_config.cache_config.block_size
        self.ratio = store_ratio(self.block_size, self.store)
        self.hasher = BlockHasher(self.model.compat_digest(), self.store.layout.block_size)
        self.tiers = TieredCache(self.store, [])  # the worker side touches no tier
        self._writer: TierWriter | None = None  # writes entries down off vLLM's loop
        if role == KVConnectorRole.SCHEDULER:
            config = TierConfig(disk_dir=extra.get("disk_dir"), redis_url=extra.get("redis_url"))
            self.tiers = TieredCache(self.store, config.build(self.model.compat_digest()))
            self._writer = TierWriter(self.tiers.tiers, self.codec, config.write_queue_bytes)
            atexit.register(self._writer.close)  # what is queued is written before exit
        self._requests: dict[str, _Request] = {}
        self._matched: dict[str, CacheBuffers] = {}  # blocks found, waiting for vLLM's
        self.async_fetch = bool(extra.get("async_fetch", True))
        # layer by layer on a thread, beside the forward: where a core is spare for it
        async_load = extra.get("async_load", "auto")
        self.async_load = spare_cores() > 0 if async_load == "auto" else bool(async_load)
        self._layer_loads = LayerLoads()
        self._fetching: dict[str, _Fetch] = {}
        self._fetcher: ThreadPoolExecutor | None = None
        self._loads: list[Load] = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._cache: CacheBuffers | None = None
        self._encoded: list[tuple[bytes, np.ndarray]] = []
        self.stats = TransferStats()
        entry_shape(self.store), cpu_kernels()  # built now, not in the first request's TTFT

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple:
        req_id, ids = request.request_id, list(request.prompt_token_ids)
        known = self._requests.get(req_id)  # asked again: its keys are the same
        keys = known.keys if known else self._keys(ids, getattr(request, "cache_salt", None))
        self._requests[req_id] = _Request(ids, keys)
        bs, r = self.block_size, self.ratio
        first, last = num_computed_tokens // bs, (len(ids) - 1) // bs  # the last token is run
        wanted = keys[first * r : last * r]
        pending = self._fetching.pop(req_id, None)
        if pending is not None and pending.first == first:
            if not pending.future.done():
                self._fetching[req_id] = pending
                self.stats.num_not_yet += 1
                return None, False  # vLLM asks again at a later step
            found = self._result(pending.future)
        elif not wanted:
            return 0, False
        elif self.async_fetch and len(self._requests) > 1:  # others in flight to overlap with
            queued = self._writer.is_queued([wanted[0].block_hash])
            if not queued and not self.tiers.holds(wanted[:1])[0]:
                return 0, False  # a miss answers at once
            self._fetching[req_id] = _Fetch(first, self._thread().submit(self._fetch, wanted))
            self.stats.num_background_fetches += 1
            self.stats.num_not_yet += 1
            return None, False
        else:
            found = self._fetch(wanted)
        num_blocks = (found.extent if found else 0) // r  # whole vLLM blocks only
        if not num_blocks:
            return 0, False
        self._matched[req_id] = narrow_blocks(found, 0, num_blocks * r)
        return (first + num_blocks) * bs - num_computed_tokens, False

    @staticmethod
    def _result(future: Future) -> CacheBuffers | None:
        """A background fetch's blocks; one that failed is a miss (vLLM recomputes)."""
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - whatever the tiers raised: never a hit
            log.warning("kvabi: a background fetch failed, the prompt is recomputed: %s", exc)
            return None

    def _thread(self) -> ThreadPoolExecutor:
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kvabi-fetch")
        return self._fetcher

    def _keys(self, ids: list[int], salt: str | None) -> list[BlockKey]:
        """The prompt's full store blocks, hashed as kvabi's engine hashes them. vLLM refuses
        an empty salt at its API; should one arrive anyway, the hasher refuses it and the
        request shares nothing (no keys: no load, no save)."""
        try:
            return self.hasher.keys(ids, salt)
        except ValueError:
            return []

    def _fetch(self, keys: list[BlockKey]) -> CacheBuffers | None:
        """The verified blocks of the longest leading run of `keys` that some tier holds (a
        bad or foreign entry is removed and ends the run; a tier that is down is a miss)."""
        if self._writer.is_queued([k.block_hash for k in keys]):
            self._writer.flush()  # a prompt after the one that saved them: read, not recompute
        start = time.perf_counter()
        found = self.tiers.fetch(keys)
        self.stats.fetch_s += time.perf_counter() - start
        self.stats.num_fetched += found.extent if found else 0
        return found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        found = self._matched.pop(request.request_id, None)
        if not num_external_tokens or found is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first = request.num_computed_tokens // self.block_size
        num_blocks = found.extent // self.ratio
        self._loads.append(Load(block_ids[first : first + num_blocks], found))

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
        bs, r = self.block_size, self.ratio
        state.num_saved = max(state.num_saved, done // bs)
        end = min(after, len(state.token_ids)) // bs
        if end > state.num_saved:
            keys = state.keys[state.num_saved * r : end * r]
            meta.saves.append(Save(state.block_ids[state.num_saved : end], keys))
            state.num_saved = end

    def update_connector_output(self, connector_output: Any) -> None:
        """Queue the entries the worker encoded for the writer thread (vLLM's loop goes on);
        what the queue cannot hold is dropped and counted (a later recompute)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvabiWorkerMetadata) or not meta.entries:
            return
        start = time.perf_counter()
        entries = [(h, memoryview(e)) for h, e in meta.entries]
        n = self._writer.reserve(len(entries), len(entries[0][1]))
        self.stats.num_write_dropped += len(entries) - n
        if n:
            self._writer.submit_entries(entries[:n], n * len(entries[0][1]))
        self.stats.write_s += time.perf_counter() - start

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._layer_loads.close()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._fetching.pop(request.request_id, None)  # a fetch still running is left to end
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
        """Queue this step's loads on the load thread, layer group by layer group
        (`LayerLoads`); with `async_load` off, place them all before the forward."""
        meta = self._get_connector_metadata()
        cache = self._vllm_cache(forward_context)  # wait_for_save reads it too
        if not meta.loads:
            return
        self._layer_loads.start(meta.loads, cache, background=self.async_load)
        for load in meta.loads:
            self.stats.num_loaded += load.blocks.extent
            self.stats.bytes_loaded += load.blocks.num_bytes

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer's blocks of the step's loads are placed."""
        from vllm.model_executor.models.utils import extract_layer_index

        self._layer_loads.wait(extract_layer_index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # whole blocks are encoded once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        self._layer_loads.finish()  # every load of the step placed (a layer never waited)
        self.stats.load_s, self.stats.load_wait_s = (
            self._layer_loads.load_s,
            self._layer_loads.wait_s,
        )
        meta = self._get_connector_metadata()
        for save in meta.saves:
            start = time.perf_counter()
            check_block_ids(save.block_ids)
            entries, num_bytes = self.codec.encode_from(self._cache, save.block_ids, save.keys)
            self._encoded += [
                (k.block_hash, np.frombuffer(e, dtype=np.uint8))
                for k, e in zip(save.keys, entries, strict=True)
            ]
            self.stats.save_s += time.perf_counter() - start
            self.stats.num_saved += len(save.keys)
            self.stats.bytes_saved += num_bytes

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._encoded:
            return None
        meta, self._encoded = KvabiWorkerMetadata(self._encoded), []
        return meta
