"""vLLM offload files without vLLM: golden vectors (taken from vLLM 0.32's own FileMapper and
hash_block_tokens, tests/interop/vllm_offload_oracle.py), the byte form, and refusals.

tests/interop/test_vllm_offload_peer.py checks the same against vLLM's code run live."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, Layout, ModelSpec
from kvabi.interop.errors import (
    ModelMismatchError,
    OffloadMissingError,
    OffloadNamespaceError,
    OffloadSizeError,
    UnsupportedTypeError,
)
from kvabi.interop.vllm_offload import file_size, page_descriptor, read_offload, write_offload
from kvabi.interop.vllm_offload_namespace import (
    OffloadGroup,
    OffloadNamespace,
    find_namespaces,
    read_namespace,
    vllm_block_hashes,
)

L, H, D, BS = 2, 4, 8, 16
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(L))
MODEL = ModelSpec((LayerSpec(ATTN, H, D, D),) * L, "tiny")
NS = OffloadNamespace("org/tiny", "bfloat16", BS, (OffloadGroup(BS, LAYERS),))
# vLLM 0.32: FileMapper(root, "org/tiny", 16, 1, 1, 1, 1, 1, 0, "bfloat16", groups,
# parallel_agnostic=True, canonical_format="v1-nhd").base_path and get_file_name
GOLDEN_BASE = "org_tiny_1164cb8857d8"
# vLLM 0.32: hash_block_tokens(sha256, ...) over tokens 0..31 in 16-token blocks
GOLDEN_HASHES = [
    "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
    "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
]


def _thc(num_tokens: int, seed: int = 0) -> CacheBuffers:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"{i}.{p}": torch.randn(num_tokens, H, D, generator=g).bfloat16()
        for i in range(L)
        for p in "kv"
    }
    return CacheBuffers(Descriptor(MODEL, Layout("THC", 0, "bf16", planes="separate")), tensors)


def test_namespace_and_paths_are_vllms():
    assert NS.base_path("/r") == Path("/r") / GOLDEN_BASE
    assert NS.config_path("/r") == Path("/r") / GOLDEN_BASE / "config.json"
    h = bytes.fromhex(GOLDEN_HASHES[1])
    want = f"/r/{GOLDEN_BASE}_r0/8be/7a_g0/{GOLDEN_HASHES[1]}.bin"
    assert str(NS.file_path("/r", h)) == want
    assert "parallel_agnostic" not in NS.fields() and NS.fields()["tp_size"] == 1
    # TP=2 collapses into the same folder: canonical pages are TP-agnostic
    assert replace(NS, tp_size=2, rank=1).base_path("/r") == NS.base_path("/r")
    assert replace(NS, parallel_agnostic=False).digest() != NS.digest()
    assert replace(NS, canonical_format="v1-hnd").digest() != NS.digest()


def test_block_hashes_are_vllms():
    assert [h.hex() for h in vllm_block_hashes(list(range(32)), BS)] == GOLDEN_HASHES
    assert len(vllm_block_hashes(list(range(47)), BS)) == 2  # whole blocks only


@pytest.mark.parametrize("fmt", ["v1-nhd", "v1-hnd"])
@pytest.mark.parametrize("form", ["packed", "split"])
def test_pages_round_trip_and_nhd_packed_bytes(tmp_path, fmt, form):
    ns = replace(NS, canonical_format=fmt, blocks_per_file=2)
    ids = list(range(100))  # 3 whole files of 32 tokens
    src = _thc(100)
    paths = write_offload(tmp_path, ns, src, ids, form)
    assert len(paths) == 3 and all(p.stat().st_size == 8192 for p in paths)  # 2 x 2 x 2 KiB
    got = read_offload(tmp_path, ns, MODEL, ids, form)
    assert got.num_tokens == 96 and got.paths == tuple(paths)
    back = convert(got.cache, src.desc, num_tokens=96)
    assert all(torch.equal(back.tensors[k], src.tensors[k][:96]) for k in src.tensors)
    if (fmt, form) == ("v1-nhd", "packed"):  # file 1 = layer 0 [32 tok, H, K|V], layer 1 ...
        data = torch.frombuffer(bytearray(paths[1].read_bytes()), dtype=torch.bfloat16)
        kv = [torch.cat([src.tensors[f"{i}.{p}"][32:64] for p in "kv"], -1) for i in range(L)]
        assert torch.equal(data.view(L, 32, H, 2 * D), torch.stack(kv))


def test_the_file_size_pads_to_the_host_page():
    model = ModelSpec((LayerSpec(ATTN, 3, D, D),) * L, "odd")  # 3 heads: 1536 B a layer
    assert file_size(page_descriptor(model, NS), NS) == 4096
    ns3 = replace(NS, blocks_per_file=3)  # 9216 B of pages
    assert file_size(page_descriptor(model, ns3), ns3) == 3 * 4096


def test_a_prefix_is_read_up_to_the_first_missing_file(tmp_path):
    ids = list(range(64))
    paths = write_offload(tmp_path, NS, _thc(64), ids)
    paths[2].unlink()
    assert read_offload(tmp_path, NS, MODEL, ids).num_tokens == 32
    paths[0].unlink()
    with pytest.raises(OffloadMissingError, match="first chunk"):
        read_offload(tmp_path, NS, MODEL, ids)
    with pytest.raises(OffloadMissingError, match="no offload folder"):
        read_offload(tmp_path / "elsewhere", NS, MODEL, ids)


def test_refusals(tmp_path):
    ids = list(range(32))
    paths = write_offload(tmp_path, NS, _thc(32), ids)
    paths[1].write_bytes(paths[1].read_bytes()[:-1])
    with pytest.raises(OffloadSizeError, match="4095 B"):
        read_offload(tmp_path, NS, MODEL, ids)
    with pytest.raises(OffloadMissingError, match="no offload folder"):
        read_offload(tmp_path, replace(NS, dtype="float16"), MODEL, ids)  # another namespace
    big = ModelSpec((LayerSpec(ATTN, 8, D, D),) * L, "big")
    with pytest.raises(OffloadSizeError):  # same namespace, a model with twice the heads
        read_offload(tmp_path, NS, big, ids[:16])
    with pytest.raises(ModelMismatchError, match="2 layers"):
        page_descriptor(ModelSpec((LayerSpec(ATTN, H, D, D),) * 3, "three"), NS)
    with pytest.raises(UnsupportedTypeError, match="full-attention"):
        page_descriptor(ModelSpec((LayerSpec(ATTN, H, D, D, window=8),) * L, "swa"), NS)
    with pytest.raises(UnsupportedTypeError, match="direct"):
        page_descriptor(MODEL, replace(NS, canonical_format=None))
    with pytest.raises(OffloadNamespaceError, match="2 KV cache groups"):
        page_descriptor(MODEL, replace(NS, groups=NS.groups * 2))
    with pytest.raises(OffloadNamespaceError, match="canonical_format"):
        replace(NS, canonical_format="v2-nhd")


def test_a_folder_must_hash_to_its_name(tmp_path):
    write_offload(tmp_path, NS, _thc(16), list(range(16)))
    base = NS.base_path(tmp_path)
    assert find_namespaces(tmp_path) == [(base, NS)] == find_namespaces(base)
    config = base / "config.json"
    fields = json.loads(config.read_text()) | {"dtype": "float16"}
    config.write_text(json.dumps(fields))
    with pytest.raises(OffloadNamespaceError, match="renamed or its config.json edited"):
        read_namespace(base)
    with pytest.raises(OffloadNamespaceError, match="renamed"):
        read_offload(tmp_path, NS, MODEL, list(range(16)))
    config.write_text("[1]")
    with pytest.raises(OffloadNamespaceError, match="not a JSON object"):
        read_namespace(base)
