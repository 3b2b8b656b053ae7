"""`kvabi inspect` / `kvabi convert` on LMCache EncodedKV blobs (interop/lmcache_blob.py).

A blob is recognised by its first 8 bytes (LMCache's magic). It holds one layer's K and V
but no token ids, so converting it to a container needs `--tokens` (a JSON array, one id per
token the blob holds). A container converts to a blob of one layer (`--blob-layer`, default 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvabi.abi.errors import KvabiError
from kvabi.cli.vllm_offload_cli import _token_ids
from kvabi.interop.lmcache_blob import INT_TO_DTYPE, MAGIC, SCALE_SCOPES, blob_bytes, parse_blob
from kvabi.wire.container import Container

FORMAT = "lmcache-blob"


def add_blob_args(p: argparse.ArgumentParser) -> None:
    """The options of `kvabi convert` to LMCache blobs."""
    g = p.add_argument_group("LMCache EncodedKV blobs (--to lmcache-blob, or a blob input)")
    g.add_argument("--blob-layer", type=int, default=0, help="to a blob: the layer it holds")
    g.add_argument("--model-id", default="", help="to a blob: its model_id identity string")


def is_lmcache_blob(path: Path) -> bool:
    """A file whose first 8 bytes are LMCache's EncodedKV magic."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def cmd_inspect(args: argparse.Namespace) -> int:
    blob = parse_blob(Path(args.file).read_bytes())  # verifies the header and the CRC32
    h = blob.header
    dtypes = [INT_TO_DTYPE[i] for i in (h.k_dtype_id, h.v_dtype_id, h.scale_dtype_id)]
    print(f"LMCache EncodedKV blob, header version 1, scale scope {SCALE_SCOPES[h.scale_scope]}")
    print("  identity: " + "  ".join(f"{k}={v!r}" for k, v in h.identity))
    print(f"  layer_id {h.layer_id}  chunk_id {h.chunk_id}  chunk_size {h.chunk_size}  "
          f"page_size {h.page_size}  kv_head_count {h.kv_head_count}  "
          f"head_dim {h.head_dim}")  # fmt: skip
    print(f"  dtypes: K {dtypes[0]}  V {dtypes[1]}  scales {dtypes[2]} {list(h.scale_shape)}")
    print(f"  payload: K {h.k_len} B  V {h.v_len} B  scales {h.scale_len} B")
    print(f"checksums: ok (CRC32 {h.crc32:#010x})")
    return 0


def cmd_convert_from(args: argparse.Namespace) -> int:
    """A blob -> a container in `--to`'s layout (the tokens from `--tokens`)."""
    from kvabi.abi.convert import convert
    from kvabi.cache.block_hasher import BlockHasher
    from kvabi.cli.containers import destination_for
    from kvabi.interop.lmcache_buffers import blob_buffers
    from kvabi.wire import write_container

    if not args.tokens:
        raise KvabiError("from an LMCache blob: --tokens is needed (the blob holds no token ids)")
    cache = blob_buffers(parse_blob(Path(args.input).read_bytes()))
    ids = _token_ids(args.tokens)
    if len(ids) != cache.extent:
        raise KvabiError(f"--tokens has {len(ids)} ids; the blob holds {cache.extent} tokens")
    dst = destination_for(cache.desc.model, args.to, args.block_size, args.dtype, len(ids))
    out = convert(cache, dst, num_tokens=len(ids))
    hashes = BlockHasher(dst.model.compat_digest(), dst.layout.block_size).hashes(ids)
    write_container(args.output, out, ids, hashes if dst.layout.block_size else [])
    print(f"{args.input}: {len(ids)} tokens, 1 layer -> {args.output} [{args.to}]")
    return 0


def convert_to(args: argparse.Namespace, c: Container) -> int:
    """A container (already read and checked) -> one layer as a blob at `args.output`."""
    from kvabi.interop.lmcache_buffers import blob_from_buffers

    identity = {"model_id": args.model_id} if args.model_id else {}
    blob = blob_from_buffers(c.cache, len(c.token_ids), args.blob_layer, identity)
    data = blob_bytes(blob)
    Path(args.output).write_bytes(data)
    print(f"{args.input} layer {args.blob_layer} -> {args.output}: {len(data)} B blob")
    return 0
