"""vLLM 0.32's native offload files (canonical format v1) read into, and written from, kvabi
caches through the ABI's descriptors.

One file holds one chunk of `blocks_per_file` blocks of the namespace's single KV cache group:
for each layer in the group's order, its canonical pages of those blocks one after another,
then zeros up to a multiple of the host page (4,096 B; vLLM's `SharedOffloadRegion` rows). A
layer's canonical page is its whole block without parallelism (every KV head, in the worker's
page encoding), so a TP=2 writer and a TP=1 reader see the same bytes. The page encoding is
the worker's layout family: `v1-nhd` (vLLM's `LBNHC`) or `v1-hnd` (`LBHNC`), and within it
the backend's tensor form, which the namespace does not record: `packed` (FlashAttention,
Triton, FlexAttention, CPU: K|V in the last axis) or `split` (ROCm AITER: K half, V half).
A file is named by vLLM's block hash of the chunk's last `tokens_per_hash` tokens' block.

The format has no header and no checksum: kvabi checks what it can (folder name against
config.json, namespace against the model, each file's size, which files exist), not the bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvabi.abi.buffers import CacheBuffers, owner_layers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import (
    ModelMismatchError,
    OffloadMissingError,
    OffloadSizeError,
    UnsupportedTypeError,
)
from kvabi.interop.vllm_offload_namespace import OffloadNamespace, vllm_block_hashes

HOST_PAGE = 4096  # mmap.PAGESIZE where vLLM wrote the files (x86-64 Linux)
PAGE_PRESETS = {  # (canonical format, tensor form) -> the kvabi preset of one page
    ("v1-nhd", "packed"): "vllm-lbnhc",
    ("v1-hnd", "packed"): "vllm-lbhnc",
    ("v1-nhd", "split"): "vllm-flashinfer",
    ("v1-hnd", "split"): "vllm-flashinfer-hnd",
}
DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


@dataclass(frozen=True)
class OffloadRead:
    """What an offload folder holds of a prompt: its leading `num_tokens` as `cache` (the
    page descriptor's blocks, `extent` = files x blocks per file), and the files read."""

    cache: CacheBuffers
    num_tokens: int
    paths: tuple[Path, ...]


def page_descriptor(model: ModelSpec, ns: OffloadNamespace, form: str = "packed") -> Descriptor:
    """The descriptor of a namespace's canonical pages for `model` (checked against it)."""
    group = ns.single_group()
    if ns.canonical_format is None:
        raise UnsupportedTypeError(
            "direct (non-canonical) offload pages are the worker's own, per TP rank: kvabi "
            "reads canonical_format v1-nhd / v1-hnd only"
        )
    preset = PAGE_PRESETS.get((ns.canonical_format, form))
    if preset is None:
        raise UnsupportedTypeError(f"page form {form!r}: one of packed, split")
    if ns.dtype not in DTYPES:
        raise UnsupportedTypeError(f"dtype {ns.dtype!r}: kvabi reads {sorted(DTYPES)}")
    layers = _check_full_attention(model)
    if len(group.layer_names) != len(layers):
        raise ModelMismatchError(
            f"the namespace's group has {len(group.layer_names)} layers, the model {len(layers)}"
        )
    return preset_descriptor(
        preset, model, block_size=group.tokens_per_block, dtype=DTYPES[ns.dtype]
    )


def _check_full_attention(model: ModelSpec) -> list[int]:
    """The model's layers, all full attention with KV of their own (one KV cache group)."""
    if any(x.kind != ATTN or x.window or not x.has_kv for x in model.layers):
        raise UnsupportedTypeError(
            "kvabi reads offload files of full-attention models only (one KV cache group)"
        )
    return list(range(model.num_layers))


def file_size(desc: Descriptor, ns: OffloadNamespace) -> int:
    """Bytes in one file: every layer's pages of a chunk, rounded up to the host page."""
    cache = CacheBuffers.empty(desc, 1)
    raw = cache.num_bytes * ns.blocks_per_file
    return -(-raw // HOST_PAGE) * HOST_PAGE


def chunk_hashes(ns: OffloadNamespace, token_ids: Sequence[int]) -> list[bytes]:
    """The block hash naming each whole file of a prompt (the hash at the chunk's end)."""
    hashes = vllm_block_hashes(token_ids, ns.tokens_per_hash)
    per_file = ns.tokens_per_file // ns.tokens_per_hash
    return [hashes[(i + 1) * per_file - 1] for i in range(len(hashes) // per_file)]


def write_offload(
    root: str | Path,
    ns: OffloadNamespace,
    cache: CacheBuffers,
    token_ids: Sequence[int],
    form: str = "packed",
) -> list[Path]:
    """Write a prompt's whole files (its KV in `cache`, any layout of the same model) as vLLM's
    fs tier would, and config.json. Existing files are left as they are, as vLLM does."""
    desc = page_descriptor(cache.desc.model, ns, form)
    hashes = chunk_hashes(ns, token_ids)
    pages = convert(cache, desc, num_tokens=len(hashes) * ns.tokens_per_file)
    _write_config(root, ns)
    size, paths = file_size(desc, ns), []
    for i, block_hash in enumerate(hashes):
        path = ns.file_path(root, block_hash)
        if not path.exists():
            _write_atomic(path, _file_bytes(pages, i, ns.blocks_per_file, size))
        paths.append(path)
    return paths


def read_offload(
    root: str | Path,
    ns: OffloadNamespace,
    model: ModelSpec,
    token_ids: Sequence[int],
    form: str = "packed",
) -> OffloadRead:
    """The leading whole files the folder holds for a prompt, as the namespace's pages.

    Refused: no folder of this namespace (OffloadMissingError: a reader of another model,
    dtype, block size or format looks elsewhere), a folder whose config.json does not hash to
    its name (OffloadNamespaceError), no file for the prompt's first chunk (OffloadMissingError), a
    file of the wrong size (OffloadSizeError)."""
    _check_config(root, ns)
    desc = page_descriptor(model, ns, form)
    size, paths = file_size(desc, ns), []
    for block_hash in chunk_hashes(ns, token_ids):
        path = ns.file_path(root, block_hash)
        if not path.is_file():
            break
        paths.append(path)
    if not paths:
        raise OffloadMissingError(f"no offload file for the prompt's first chunk under {root}")
    cache = CacheBuffers.empty(desc, len(paths) * ns.blocks_per_file)
    for i, path in enumerate(paths):
        _read_file(path, cache, i * ns.blocks_per_file, ns.blocks_per_file, size)
    return OffloadRead(cache, len(paths) * ns.tokens_per_file, tuple(paths))


def _layer_tensors(cache: CacheBuffers) -> list[torch.Tensor]:
    """Each layer's one tensor, in layer order (a K|V-in-one-tensor layout: key = layer)."""
    return [cache.tensors[str(i)] for i in owner_layers(cache.desc)]


def _file_bytes(pages: CacheBuffers, index: int, per_file: int, size: int) -> bytes:
    blocks = slice(index * per_file, (index + 1) * per_file)
    raw = b"".join(_as_bytes(t[blocks]) for t in _layer_tensors(pages))
    return raw + bytes(size - len(raw))


def _read_file(path: Path, cache: CacheBuffers, first: int, per_file: int, size: int) -> None:
    data = path.read_bytes()
    if len(data) != size:
        raise OffloadSizeError(f"{path}: {len(data)} B, the namespace and model give {size} B")
    offset = 0
    for t in _layer_tensors(cache):
        dst = t[first : first + per_file]
        n = dst.numel() * dst.element_size()
        dst.copy_(
            torch.frombuffer(bytearray(data[offset : offset + n]), dtype=t.dtype).view(dst.shape)
        )
        offset += n
    if any(data[offset:]):
        raise OffloadSizeError(f"{path}: non-zero bytes past the last layer's pages")


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_config(root: str | Path, ns: OffloadNamespace) -> None:
    path = ns.config_path(root)
    if path.exists():
        _check_config(root, ns)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(ns.fields(), indent=2, sort_keys=True).encode("utf-8"))


def _check_config(root: str | Path, ns: OffloadNamespace) -> None:
    from kvabi.interop.vllm_offload_namespace import read_namespace

    base = ns.base_path(root)
    if not base.is_dir():
        raise OffloadMissingError(f"{base}: no offload folder of this namespace")
    read_namespace(base)  # its config.json must hash to its name (so, be `ns`)
