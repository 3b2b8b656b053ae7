"""vLLM offload files against vLLM 0.32's own offload code (tests/interop/vllm_offload_oracle.py,
run in .venv-vllm): vLLM writes files that kvabi reads, kvabi writes files that vLLM loads.

vLLM's offloading connector itself refuses to start on a CPU-only vLLM ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs", `CPUOffloadingSpec.get_worker`), so the
oracle runs the parts it is made of: the mapping derivation and copy plans for each TP rank,
the shared host region, the fs tier's writes and reads, and vLLM's block hashes, which name
the files (kvabi computes its own and must land on the same paths).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.connectors.vllm_handoff import ROOT, VLLM_PYTHON
from kvabi.interop.vllm_offload import read_offload, write_offload
from kvabi.interop.vllm_offload_namespace import OffloadGroup, OffloadNamespace, read_namespace
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = VLLM_MARKS
ORACLE = ROOT / "tests" / "interop" / "vllm_offload_oracle.py"
L, D, BS, FILES = 2, 8, 16, 3
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
FORMATS = {"LBNHC": "v1-nhd", "LBHNC": "v1-hnd"}
LOGICAL = {"packed": "vllm-lbhnc", "split": "vllm-flashinfer"}  # vLLM's logical shapes


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    layout: str
    page: str
    bpc: int
    heads: int = 4

    @property
    def model(self) -> ModelSpec:
        return ModelSpec((LayerSpec(ATTN, self.heads, D, D),) * L, f"tiny-{self.heads}")

    @property
    def ns(self) -> OffloadNamespace:
        group = (OffloadGroup(BS, tuple(LAYERS)),)
        fmt = FORMATS[self.layout]
        return OffloadNamespace("org/tiny", "bfloat16", BS, group, self.bpc, fmt, self.tp)

    @property
    def token_ids(self) -> list[int]:
        return list(range(1000, 1000 + FILES * self.bpc * BS + 5))  # 5 past the last file


CASES = [
    Case("tp1-nhd-packed", 1, "LBNHC", "packed", 1),
    Case("tp2-nhd-packed", 2, "LBNHC", "packed", 1),  # the same bytes as tp1: TP-agnostic
    Case("tp2-hnd-packed-2per", 2, "LBHNC", "packed", 2),
    Case("tp2-nhd-split", 2, "LBNHC", "split", 1),
    Case("tp1-hnd-split-2per", 1, "LBHNC", "split", 2),
    Case("tp4-nhd-packed-gqa", 4, "LBNHC", "packed", 1, heads=2),  # 2 ranks share each head
]


def _source(case: Case) -> CacheBuffers:
    seed = sum(map(ord, f"{case.layout}{case.page}{case.bpc}{case.heads}"))  # not the TP
    g = torch.Generator().manual_seed(seed)
    n = len(case.token_ids)
    tensors = {f"{i}.{p}": torch.randn(n, case.heads, D, generator=g).bfloat16()
               for i in range(L) for p in "kv"}  # fmt: skip
    return CacheBuffers(
        Descriptor(case.model, Layout("THC", 0, "bf16", planes="separate")), tensors
    )


def _logical(case: Case, src: CacheBuffers) -> torch.Tensor:
    """[L, blocks, *vLLM's logical page]: (B,H,N,2D) packed, (B,2,N,H,D) split."""
    desc = preset_descriptor(LOGICAL[case.page], case.model, block_size=BS, dtype="bf16")
    blocks = convert(src, desc, num_tokens=FILES * case.bpc * BS)
    per_layer = [blocks.tensors[str(i)] for i in range(L)]
    if case.page == "packed":  # [B, H, N, 2, D] -> [B, H, N, 2D]
        per_layer = [t.flatten(-2) for t in per_layer]
    return torch.stack(per_layer)


def _job(case: Case, op: str, root: Path, kv: Path) -> dict:
    return {
        "op": op, "root": str(root), "model_name": "org/tiny", "dtype": "bfloat16",
        "block_size": BS, "tokens_per_hash": BS, "blocks_per_chunk": case.bpc,
        "layer_names": LAYERS, "num_kv_heads": case.heads, "head_size": D, "tp_size": case.tp,
        "layout": case.layout, "page": case.page, "token_ids": case.token_ids,
        "kv_path": str(kv), "out_kv_path": str(kv.with_suffix(".loaded.pt")),
    }  # fmt: skip


@dataclass
class Run:
    out: Path
    sources: dict[str, CacheBuffers]
    stored: dict[str, dict]  # vLLM wrote (root vllm-<case>)
    loaded: dict[str, dict]  # vLLM read kvabi's files (root kvabi-<case>)
    kvabi_paths: dict[str, list[Path]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("vllm-offload")
    jobs, sources, kvabi_paths = [], {}, {}
    for case in CASES:
        src = sources[case.name] = _source(case)
        kv = out / f"{case.name}.pt"
        torch.save(_logical(case, src), kv)
        jobs.append(_job(case, "store", out / f"vllm-{case.name}", kv))
        paths = write_offload(out / f"kvabi-{case.name}", case.ns, src, case.token_ids, case.page)
        kvabi_paths[case.name] = paths
        jobs.append(_job(case, "load", out / f"kvabi-{case.name}", kv))
    (out / "jobs.json").write_text(json.dumps(jobs), encoding="utf-8")
    cmd = [str(VLLM_PYTHON), str(ORACLE), str(out / "jobs.json"), str(out / "results.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    names = [c.name for c in CASES]
    return Run(out, sources, dict(zip(names, results[0::2], strict=True)),
               dict(zip(names, results[1::2], strict=True)), kvabi_paths)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vllm_writes_kvabi_reads(run: Run, case: Case):
    root = run.out / f"vllm-{case.name}"
    stored = run.stored[case.name]
    assert [str(case.ns.file_path(root, h)) for h in _hashes(case)] == stored["paths"]
    assert stored["config_path"] == str(case.ns.config_path(root))
    assert read_namespace(case.ns.base_path(root)).fields() == case.ns.fields()  # vLLM wrote it
    got = read_offload(root, case.ns, case.model, case.token_ids, case.page)
    assert got.num_tokens == FILES * case.bpc * BS
    src = run.sources[case.name]
    back = convert(got.cache, src.desc, num_tokens=got.num_tokens)
    for key, want in src.tensors.items():
        assert torch.equal(back.tensors[key], want[: got.num_tokens]), key
    assert all(p.stat().st_size == stored["row_bytes"] for p in got.paths)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kvabi_writes_vllm_loads(run: Run, case: Case):
    loaded = run.loaded[case.name]
    assert loaded["paths"] == [str(p) for p in run.kvabi_paths[case.name]]  # vLLM's own hashes
    kv = run.out / f"{case.name}.pt"
    assert torch.equal(torch.load(kv.with_suffix(".loaded.pt")), torch.load(kv))
    vllm_files = sorted((run.out / f"vllm-{case.name}").rglob("*.bin"))
    kvabi_files = sorted((run.out / f"kvabi-{case.name}").rglob("*.bin"))
    assert [p.read_bytes() for p in vllm_files] == [p.read_bytes() for p in kvabi_files]


def test_canonical_pages_do_not_depend_on_tp(run: Run):
    one, two = (run.out / f"vllm-tp{n}-nhd-packed" for n in (1, 2))
    files = [sorted(p.relative_to(r) for p in r.rglob("*.bin")) for r in (one, two)]
    assert files[0] == files[1] and len(files[0]) == FILES
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files[0])
    assert replace(CASES[0].ns, tp_size=2).digest() == CASES[0].ns.digest()


def _hashes(case: Case) -> list[bytes]:
    from kvabi.interop.vllm_offload import chunk_hashes

    return chunk_hashes(case.ns, case.token_ids)
