"""`kvabi inspect` and `kvabi convert`: a container verified, shown, converted.

Both verify every checksum first. Token ids are checked against the vocabulary where it is
known: the model given with `--model` (a GGUF, an HF folder or a bundled name; its
fingerprint must then be the container's), else the catalog model the fingerprint names. A
conversion's block size must be at most `max(tokens held, MAX_BLOCK_SIZE)`: a block past the
tokens held is padding only, and no engine pages in blocks over 1,024 tokens.
"""

from __future__ import annotations

import argparse

from kvabi.abi.buffers import owner_layers
from kvabi.abi.catalog import catalog_vocab_size
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.errors import KvabiError
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.cli import lmcache_blob_cli, vllm_offload_cli
from kvabi.cli.peer_formats import detect_peer_format
from kvabi.wire.container import Container, check_token_ids

MAX_BLOCK_SIZE = 1024


def add_container_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="show a container (or a peer's KV folder) and verify its checksums"
    )
    p.add_argument("file")
    p.add_argument("--model", help="check the token ids against this model's vocabulary")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("convert", help="convert a container to another engine's layout")
    p.add_argument("input")
    p.add_argument("output")
    targets = sorted(PRESETS) + [vllm_offload_cli.FORMAT, lmcache_blob_cli.FORMAT]
    p.add_argument("--to", required=True, choices=targets, metavar="PRESET")
    p.add_argument("--block-size", type=int)
    p.add_argument("--dtype")
    p.add_argument("--model", help="check the token ids against this model's vocabulary")
    vllm_offload_cli.add_offload_args(p)
    lmcache_blob_cli.add_blob_args(p)
    p.set_defaults(fn=cmd_convert)


def cmd_inspect(args: argparse.Namespace) -> int:
    peer = detect_peer_format(args.file)
    if peer is not None:
        return peer.inspect(args)
    c = _read(args.file, args.model)
    desc = c.desc
    print(f"descriptor: {desc}")
    print(f"compat digest: {desc.model.compat_digest()}")
    tokens = list(c.token_ids)
    print(f"tokens: {len(tokens)}  first: {tokens[:12]}")
    print(
        f"block hashes: {len(c.block_hashes)}"
        + (f"  first: {c.block_hashes[0].hex()[:32]}..." if c.block_hashes else "")
    )
    layers = owner_layers(desc)
    per_layer = c.cache.num_bytes // max(len(layers), 1)
    print(
        f"sections: {len(layers)} layers x {per_layer} B = {c.cache.num_bytes} B payload "
        f"({c.cache.num_bytes / max(len(tokens), 1):.0f} B/token)"
    )
    print("checksums: ok")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvabi.abi.convert import convert
    from kvabi.wire import write_container

    peer = detect_peer_format(args.input)
    if peer is not None:
        return peer.convert_from(args)
    c = _read(args.input, args.model)
    if args.to == vllm_offload_cli.FORMAT:
        return vllm_offload_cli.convert_to(args, c)
    if args.to == lmcache_blob_cli.FORMAT:
        return lmcache_blob_cli.convert_to(args, c)
    dst_desc = destination_for(c.desc.model, args.to, args.block_size, args.dtype, len(c.token_ids))
    out = convert(c.cache, dst_desc, num_tokens=len(c.token_ids))
    write_container(args.output, out, list(c.token_ids), list(c.block_hashes))
    print(
        f"{args.input} [{c.desc.layout.name or c.desc.layout.axes}] -> {args.output} "
        f"[{args.to}]: {len(c.token_ids)} tokens, {out.num_bytes} B payload"
    )
    return 0


def destination_for(
    model: ModelSpec, preset: str, block_size: int | None, dtype: str | None, num_tokens: int
) -> Descriptor:
    """The descriptor a conversion of `num_tokens` tokens writes (`--to` and its options)."""
    if preset in (vllm_offload_cli.FORMAT, lmcache_blob_cli.FORMAT):
        raise KvabiError(f"--to {preset}: a peer's format is read into a preset's layout")
    if block_size is not None:
        limit = max(num_tokens, MAX_BLOCK_SIZE)
        if not 1 <= block_size <= limit:
            raise KvabiError(
                f"--block-size {block_size}: must be in [1, {limit}] for {num_tokens} "
                f"tokens (a block past the tokens held is only padding)"
            )
    overrides = {k: v for k, v in (("block_size", block_size), ("dtype", dtype)) if v is not None}
    desc = preset_descriptor(preset, model, **overrides)
    if desc.layout.is_cross_layer:
        raise KvabiError(
            f"{preset} is a cross-layer pool layout; containers hold one "
            "section per layer, so pick a per-layer preset"
        )
    return desc


def _read(path: str, model: str | None) -> Container:
    from kvabi.wire import read_container

    c = read_container(path)  # verifies every checksum before returning
    vocab = _model_vocab(model, c.desc) if model else catalog_vocab_size(c.desc.model.fingerprint)
    if vocab is not None:
        check_token_ids(c.token_ids, vocab)
    return c


def _model_vocab(model: str, desc: Descriptor) -> int:
    """The vocabulary size of `model`, whose fingerprint must be the container's."""
    fingerprint, vocab = _fingerprint_and_vocab(model)
    if fingerprint != desc.model.fingerprint:
        raise KvabiError(
            f"--model {model}: fingerprint {fingerprint} is not the container's "
            f"({desc.model.fingerprint}); its cache is of another model"
        )
    return vocab


def _fingerprint_and_vocab(model: str) -> tuple[str, int]:
    """The fingerprint the engine gives `model` (as `LLM` computes it) and its vocab size."""
    from kvabi.interop.model_spec import gguf_fingerprint, state_dict_fingerprint
    from kvabi.models.gguf_loader import open_gguf, read_config
    from kvabi.models.registry import load_model, resolve_model

    source = resolve_model(model)
    if source.format == "gguf":  # metadata only: no weights are read
        return gguf_fingerprint(source.path), read_config(open_gguf(source.path)).vocab_size
    loaded = load_model(source.path, "fp32", progress=False)
    return state_dict_fingerprint(loaded.model.state_dict()), loaded.config.vocab_size
