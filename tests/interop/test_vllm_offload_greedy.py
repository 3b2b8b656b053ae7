"""A real model's KV through vLLM offload files, both ways, continued greedily by both engines.

vLLM's offloading connector does not start on a CPU-only vLLM, so vLLM's own offload code
(tests/interop/vllm_offload_oracle.py: the fs tier, the canonical mapping and copy plans, the
block hashes) does the file side, and the real vLLM process (vllm_kv_worker.py) the model side:

- kvabi -> vLLM: kvabi's engine prefills the counting prompt; kvabi writes its KV as offload
  files; vLLM's fs tier finds them under its own block hashes and loads them into a worker's
  cache tensors; those go into the running vLLM's cached blocks and vLLM continues (a prefix
  hit of 384 tokens; zeroing those blocks changes the output, so they are read).
- vLLM -> kvabi: vLLM's KV of the same prompt (read from its CPU cache) is stored by vLLM's fs
  tier as offload files; kvabi reads them and its engine continues from them (a disk hit).
Greedy tokens must equal vLLM's own.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_hasher import BlockHasher
from kvabi.connectors.vllm_handoff import (
    VLLM_PYTHON,
    Handoff,
    kvabi_export,
    kvabi_from_vllm,
    prepare,
    run_worker,
)
from kvabi.interop.vllm_offload import read_offload, write_offload
from kvabi.interop.vllm_offload_namespace import OffloadGroup, OffloadNamespace
from kvabi.wire import read_container, write_container
from tests.interop.test_vllm_offload_peer import ORACLE
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.big]  # 160 s of real vLLM runs: make big, .ci/run
BS = 16  # vLLM's GPU block size, the offload files' block; vLLM CPU's own cache uses 128
HELD = 384  # the prompt's tokens in whole 128-token blocks: what vLLM caches and imports


def _namespace(h: Handoff) -> OffloadNamespace:
    names = tuple(
        f"model.layers.{i}.self_attn.attn" for i in range(h.descriptor().model.num_layers)
    )
    return OffloadNamespace(str(h.out_dir / "hf"), "bfloat16", BS, (OffloadGroup(BS, names),))


def _oracle(h: Handoff, op: str, root: Path, kv: Path) -> dict:
    model = h.descriptor().model
    ns = _namespace(h)
    job = {
        "op": op, "root": str(root), "model_name": ns.model_name, "dtype": ns.dtype,
        "block_size": BS, "tokens_per_hash": BS, "blocks_per_chunk": 1,
        "layer_names": list(ns.groups[0].layer_names), "num_kv_heads": model.layers[0].num_heads,
        "head_size": model.layers[0].k_dim, "tp_size": 1, "layout": "LBNHC", "page": "packed",
        "token_ids": h.prompt_ids[:HELD], "kv_path": str(kv), "out_kv_path": str(kv),
    }  # fmt: skip
    jobs, results = h.out_dir / f"oracle-{op}.json", h.out_dir / f"oracle-{op}.out.json"
    jobs.write_text(json.dumps([job]), encoding="utf-8")
    proc = subprocess.run([str(VLLM_PYTHON), str(ORACLE), str(jobs), str(results)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(results.read_text(encoding="utf-8"))[0]


def _logical_desc(h: Handoff):
    return preset_descriptor("vllm-lbhnc", h.descriptor().model, block_size=BS, dtype="bf16")


def _logical_to_container(h: Handoff, kv: Path, path: Path) -> None:
    """vLLM's logical [L, B, H, N, 2D] tensor (what its loader filled) as a container."""
    full, desc = torch.load(kv), _logical_desc(h)
    tensors = {str(i): t.unflatten(-1, (2, -1)) for i, t in enumerate(full)}
    ids = h.prompt_ids[:HELD]
    write_container(path, CacheBuffers(desc, tensors), ids,
                    BlockHasher(desc.model.compat_digest(), BS).hashes(ids))  # fmt: skip


def _container_to_logical(h: Handoff, path: Path, kv: Path) -> None:
    src = read_container(path, expect=h.descriptor().model)
    blocks = convert(src.cache, _logical_desc(h), num_tokens=HELD)
    layers = h.descriptor().model.num_layers
    torch.save(torch.stack([blocks.tensors[str(i)].flatten(-2) for i in range(layers)]), kv)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("vllm-offload-greedy")
    h = prepare(out, "bf16")
    ns = _namespace(h)
    kvabi_own = kvabi_export(h, out / "kvabi.kvabi")
    kvabi_kv = read_container(out / "kvabi.kvabi", expect=h.descriptor().model).cache
    written = write_offload(out / "kvabi-offload", ns, kvabi_kv, h.prompt_ids)
    loaded = _oracle(h, "load", out / "kvabi-offload", out / "loaded.pt")
    _logical_to_container(h, out / "loaded.pt", out / "from-offload.kvabi")
    vllm = run_worker(h, "bf16", out / "from-offload.kvabi")

    _container_to_logical(h, out / "vllm-bf16.kvabi", out / "vllm.pt")
    stored = _oracle(h, "store", out / "vllm-offload", out / "vllm.pt")
    got = read_offload(out / "vllm-offload", ns, h.descriptor().model, h.prompt_ids)
    ids = h.prompt_ids[: got.num_tokens]
    hashes = BlockHasher(got.cache.desc.model.compat_digest(), BS).hashes(ids)
    write_container(out / "kvabi-from-offload.kvabi", got.cache, ids, hashes)
    kvabi = kvabi_from_vllm(h, out / "kvabi-from-offload.kvabi")
    return {"kvabi_own": kvabi_own, "vllm": vllm, "kvabi": kvabi, "written": written,
            "loaded": loaded, "stored": stored, "read": got}  # fmt: skip


def test_vllm_continues_from_kvabis_offload_files(result: dict):
    vllm = result["vllm"]
    assert result["loaded"]["paths"] == [str(p) for p in result["written"]]  # vLLM's hashes
    assert len(result["written"]) == HELD // BS
    assert vllm["imported"]["num_cached_tokens"] == HELD
    assert vllm["imported"]["tokens"] == vllm["own"]["tokens"]
    assert vllm["zeroed"]["tokens"] != vllm["own"]["tokens"]  # the loaded blocks are read


def test_kvabi_continues_from_vllms_offload_files(result: dict):
    assert [str(p) for p in result["read"].paths] == result["stored"]["paths"]
    assert result["read"].num_tokens == HELD
    assert result["kvabi"]["disk_hit_tokens"] == HELD
    assert result["kvabi"]["tokens"] == result["vllm"]["own"]["tokens"]
