"""vLLM's own offload code as the oracle for kvabi/interop/vllm_offload.py (runs in .venv-vllm).

vLLM 0.32's offloading connector does not run on a CPU-only vLLM (`CPUOffloadingSpec.get_worker`
refuses any platform that is not CUDA-alike or XPU), so this script drives the pieces it is
made of, all vLLM's: `CPUOffloadingSpec` (the chunk row size), `SharedOffloadRegion` (the host
buffer and its canonical views), `derive`'s per-layer `_layer_mapping` and the worker's
`_build_copy_plan` (where each rank's bytes go in the canonical page), `FileSystemTierManager`
(file names, config.json, the bytes written and read) and `hash_block_tokens` (block hashes).
The only code here is the byte copy the GPU kernel would do, fragment by fragment as the copy
plan lists them.

    .venv-vllm/bin/python tests/interop/vllm_offload_oracle.py JOB.json OUT.json

Job: {"op": "store" | "load" | "hashes", "root", "model_name", "dtype", "block_size",
"tokens_per_hash", "blocks_per_chunk", "layer_names", "num_kv_heads", "head_size", "tp_size",
"layout" (LBNHC | LBHNC), "page" (packed | split), "kv_path" (torch.save'd [L, num_blocks,
*page shape], the full heads), "block_hashes" (hex, one per file) or "token_ids" (vLLM hashes
them), "out_kv_path" (load)}.
The job file holds a list of jobs (one start-up of vLLM's imports); the result, a list.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _config(job: dict[str, Any], row_bytes: int, num_chunks: int) -> Any:
    from vllm.v1.kv_offload import config as c

    tp = job["tp_size"]
    chunk = -(-row_bytes * tp * job["blocks_per_chunk"] // 4096) * 4096  # as the spec rounds
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(job["block_size"], tuple(job["layer_names"]), 0),),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunk * num_chunks},  # a /dev/shm file this big
        engine_id=f"oracle-{uuid.uuid4().hex[:8]}",
        model=c.OffloadingModelConfig(job["model_name"], job["dtype"]),
        cache=c.OffloadingCacheConfig(job["tokens_per_hash"], job["blocks_per_chunk"]),
        parallel=c.OffloadingParallelConfig(0, tp, tp, 1, 1, 1, 0, 1, None, True),
        canonical_layout=True,
        kv_cache_layout=job["layout"],
    )


def _local(job: dict[str, Any], num_blocks: int, heads: int) -> torch.Tensor:
    """One rank's physical cache tensor, viewed in vLLM's logical shape."""
    bs, d, dt = job["block_size"], job["head_size"], DTYPES[job["dtype"]]
    nhd = job["layout"] == "LBNHC"
    if job["page"] == "packed":  # logical (B, H, N, 2D)
        if nhd:
            return torch.zeros(num_blocks, bs, heads, 2 * d, dtype=dt).permute(0, 2, 1, 3)
        return torch.zeros(num_blocks, heads, bs, 2 * d, dtype=dt)
    if nhd:  # split, logical (B, 2, N, H, D)
        return torch.zeros(num_blocks, 2, bs, heads, d, dtype=dt)
    return torch.zeros(num_blocks, 2, heads, bs, d, dtype=dt).permute(0, 1, 3, 2, 4)


def _head_axis(job: dict[str, Any]) -> int:
    return 1 if job["page"] == "packed" else 3


def _page_bytes(t: torch.Tensor) -> np.ndarray:
    """[num_blocks, page bytes] over the tensor's own storage (its physical order)."""
    base = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return base.view(torch.uint8).numpy().reshape(t.shape[0], -1)


class Ranks:
    """Every TP rank's cache tensors, mappings and copy plans, over one shared region."""

    def __init__(self, job: dict[str, Any], num_blocks: int, num_chunks: int):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.kv_offload.base import CanonicalKVCacheRef
        from vllm.v1.kv_offload.cpu.gpu_worker import _build_copy_plan
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        tp, total = job["tp_size"], job["num_kv_heads"]
        self.job, self.heads = job, max(1, total // tp)
        spec_l = FullAttentionSpec(
            block_size=job["block_size"], num_kv_heads=self.heads,
            head_size=job["head_size"], dtype=DTYPES[job["dtype"]],
        )  # fmt: skip
        num_layers = len(job["layer_names"])
        self.config = _config(job, spec_l.page_size_bytes * num_layers, num_chunks)
        self.spec = CPUOffloadingSpec(self.config)
        self.tensors = [[_local(job, num_blocks, self.heads) for _ in range(num_layers)]
                        for _ in range(tp)]  # fmt: skip
        self.mappings, self.plans, self.views, self.regions = [], [], [], []
        for rank in range(tp):
            ctx = cm._RankContext(tp, 1, 1, 1, total, rank)
            maps = [cm._layer_mapping(spec_l, t, num_blocks, ctx) for t in self.tensors[rank]]
            assert all(m is not None for m in maps), "vLLM cannot certify this layout"
            self.mappings.append(maps)
            refs = [CanonicalKVCacheRef(i, m.local_page_size_bytes, m) for i, m in enumerate(maps)]
            self.plans.append(
                [(_build_copy_plan(r, True), _build_copy_plan(r, False)) for r in refs]
            )
            region = SharedOffloadRegion(
                self.config.engine_id, self.spec.num_chunks, rank,
                self.spec.kv_bytes_per_chunk, self.spec.cpu_page_size_per_worker,
            )  # fmt: skip
            self.regions.append(region)
            bpc = job["blocks_per_chunk"]
            self.views.append(
                [region.create_next_canonical_view(m.canonical_page_size_bytes * bpc) for m in maps]
            )
        self.host = SharedOffloadRegion(
            self.config.engine_id, self.spec.num_chunks, None,
            self.spec.kv_bytes_per_chunk, self.spec.cpu_page_size_per_worker,
        )  # fmt: skip

    def close(self) -> None:
        """Unlink the shared region's /dev/shm file (vLLM's creator does it on cleanup)."""
        path = self.host.mmap_path
        for region in [*self.regions, self.host]:
            region.cleanup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def copy(self, num_chunks: int, to_host: bool) -> None:
        """What the worker's swap kernel does: each plan fragment, each block of each chunk."""
        bpc = self.job["blocks_per_chunk"]
        for rank, layers in enumerate(self.tensors):
            for li, t in enumerate(layers):
                local = _page_bytes(t)
                mapping = self.mappings[rank][li]
                view = self.views[rank][li].view(torch.uint8).numpy()
                plan = self.plans[rank][li][0 if to_host else 1]
                page = mapping.canonical_page_size_bytes
                for block in range(num_chunks * bpc):
                    if to_host and not mapping.is_writer(block):
                        continue
                    chunk, sub = divmod(block, bpc)
                    host = view[chunk, sub * page : (sub + 1) * page]
                    src, dst = (local[block], host) if to_host else (host, local[block])
                    for s, d, n in zip(plan.frag_offsets_src, plan.frag_offsets_dst,
                                       plan.frag_sizes, strict=True):  # fmt: skip
                        dst[int(d) : int(d) + int(n)] = src[int(s) : int(s) + int(n)]

    def tier(self) -> Any:
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        view = self.host.create_kv_memoryview()
        return FileSystemTierManager(self.spec, view, "fs", self.job["root"], 1, 1)


def _chunk_hashes(job: dict[str, Any]) -> list[str]:
    """The files' block hashes: given, or vLLM's own for `token_ids` (each chunk's last)."""
    if "token_ids" not in job:
        return job["block_hashes"]
    all_hashes = hashes(job)["block_hashes"]
    per_file = job["block_size"] * job["blocks_per_chunk"] // job["tokens_per_hash"]
    return [all_hashes[i - 1] for i in range(per_file, len(all_hashes) + 1, per_file)]


def _keys(job: dict[str, Any]) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(bytes.fromhex(h), 0) for h in _chunk_hashes(job)]


def _transfer(tier: Any, keys: list[bytes], load: bool) -> list[str]:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    job = TransferJob(1, keys, np.arange(len(keys)), load, ReqContext("oracle"))
    (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    deadline = time.monotonic() + 30
    results = []
    while not results and time.monotonic() < deadline:
        results = list(tier.get_finished_jobs())
    assert results and all(r.success for r in results), f"fs tier transfer failed: {results}"
    return [tier.file_mapper.get_file_name(k) for k in keys]


def _full_to_ranks(ranks: Ranks, full: torch.Tensor) -> None:
    axis = _head_axis(ranks.job)
    for rank, layers in enumerate(ranks.tensors):
        for li, t in enumerate(layers):
            replication = len(ranks.tensors) * ranks.heads // ranks.job["num_kv_heads"]
            lo = rank // replication * ranks.heads  # vLLM's head_shard (TP > KV heads: shared)
            t.copy_(full[li].narrow(axis, lo, ranks.heads))


def _ranks_to_full(ranks: Ranks) -> torch.Tensor:
    axis, total = _head_axis(ranks.job), ranks.job["num_kv_heads"]
    step = max(1, len(ranks.tensors) * ranks.heads // total)  # ranks per head shard
    shards = [ranks.tensors[r] for r in range(0, len(ranks.tensors), step)]
    return torch.stack([torch.cat([s[li] for s in shards], axis) for li in range(len(shards[0]))])


def store(job: dict[str, Any]) -> dict[str, Any]:
    full = torch.load(job["kv_path"])
    num_chunks = len(_chunk_hashes(job))
    ranks = Ranks(job, full.shape[1], num_chunks)
    try:
        _full_to_ranks(ranks, full)
        ranks.copy(num_chunks, to_host=True)
        tier = ranks.tier()
        paths = _transfer(tier, _keys(job), load=False)
        tier.shutdown()
    finally:
        ranks.close()
    return {"paths": paths, "config_path": tier.file_mapper.get_config_file_path(),
            "row_bytes": ranks.spec.kv_bytes_per_chunk}  # fmt: skip


def load(job: dict[str, Any]) -> dict[str, Any]:
    num_chunks = len(_chunk_hashes(job))
    ranks = Ranks(job, num_chunks * job["blocks_per_chunk"], num_chunks)
    try:
        tier = ranks.tier()
        paths = _transfer(tier, _keys(job), load=True)
        tier.shutdown()
        ranks.copy(num_chunks, to_host=False)
        torch.save(_ranks_to_full(ranks), job["out_kv_path"])
    finally:
        ranks.close()
    return {"paths": paths}


def hashes(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as u

    fn = get_hash_fn_by_name("sha256")
    u.init_none_hash(fn)
    ids, bs, parent, out = job["token_ids"], job["tokens_per_hash"], None, []
    for i in range(len(ids) // bs):
        parent = u.hash_block_tokens(fn, parent, ids[i * bs : (i + 1) * bs])
        out.append(bytes(parent).hex())
    return {"none_hash": bytes(u.NONE_HASH).hex(), "block_hashes": out}


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        jobs = json.load(f)  # a list: one start-up
    ops = {"store": store, "load": load, "hashes": hashes}
    result = [ops[job["op"]](job) for job in jobs]
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
