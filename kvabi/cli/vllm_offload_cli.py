"""`kvabi inspect` / `kvabi convert` on vLLM's native offload folders (interop/vllm_offload.py).

An offload root (or one namespace folder in it) is recognised by a `config.json` of vLLM's
FileMapper fields. The files hold no token ids and no model identity, so reading them into a
container needs the prompt's token ids (`--tokens`, a JSON array) and the model (`--model`, a
GGUF or a bundled name: its KV geometry and fingerprint); kvabi then finds the files by vLLM's
block hashes of those tokens. Writing them needs the name vLLM knows the model by
(`--model-name`) and vLLM's attention layer names (`--layer-names`, `{}` is the index).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from kvabi.abi.descriptor import ModelSpec
from kvabi.abi.errors import KvabiError
from kvabi.interop.vllm_offload import DTYPES, file_size, page_descriptor, read_offload
from kvabi.interop.vllm_offload_namespace import (
    CONFIG_NAME,
    OffloadGroup,
    OffloadNamespace,
    find_namespaces,
)
from kvabi.wire.container import Container

FORMAT = "vllm-offload"
LAYER_NAMES = "model.layers.{}.self_attn.attn"  # vLLM's Llama-family attention layers


def add_offload_args(p: argparse.ArgumentParser) -> None:
    """The options of `kvabi convert` to and from vLLM offload folders."""
    g = p.add_argument_group("vLLM offload folders (--to vllm-offload, or an offload input)")
    g.add_argument("--tokens", help="from offload: a JSON array of the prompt's token ids")
    g.add_argument("--page", default="packed", choices=["packed", "split"],
                   help="the worker's tensor form: packed K|V (FlashAttention, Triton, CPU) "
                   "or split (ROCm AITER)")  # fmt: skip
    g.add_argument("--model-name", help="to offload: the model name vLLM was started with")
    g.add_argument("--offload-format", default="v1-nhd", choices=["v1-nhd", "v1-hnd"])
    g.add_argument("--blocks-per-file", type=int, default=1)
    g.add_argument("--tokens-per-hash", type=int, help="to offload: default the block size")
    g.add_argument("--layer-names", default=LAYER_NAMES)


def is_vllm_offload(path: Path) -> bool:
    """An offload root or namespace folder: a directory with a FileMapper config.json."""
    if not path.is_dir():
        return False
    configs = [path / CONFIG_NAME, *path.glob(f"*/{CONFIG_NAME}")]
    return any(_is_mapper_config(c) for c in configs if c.is_file())


def cmd_inspect(args: argparse.Namespace) -> int:
    model = _model_spec(args.model) if args.model else None
    page = getattr(args, "page", "packed")  # inspect has no --page: the sizes are the same
    for base, ns in find_namespaces(args.file):
        group = ns.single_group() if len(ns.groups) == 1 else None
        print(f"namespace: {base.name}  (config.json hashes to the folder name: ok)")
        print(f"  model: {ns.model_name}  dtype: {ns.dtype}  format: {ns.canonical_format}")
        print(f"  tokens per hash: {ns.tokens_per_hash}  blocks per file: {ns.blocks_per_file}"
              f"  groups: {len(ns.groups)}"
              + (f"  tokens per block: {group.tokens_per_block}  layers: {len(group.layer_names)}"
                 if group else ""))  # fmt: skip
        sizes = Counter(p.stat().st_size for p in _files(base))
        print(f"  files: {sum(sizes.values())}  sizes: {dict(sorted(sizes.items()))}")
        if model is not None:
            want = file_size(page_descriptor(model, ns, page), ns)
            wrong = sum(n for size, n in sizes.items() if size != want)
            print(f"  expected size for --model: {want} B; files of another size: {wrong}")
            if wrong:
                return 1
    print("checksums: none in this format (names, namespace and sizes checked only)")
    return 0


def cmd_convert_from(args: argparse.Namespace) -> int:
    """An offload folder -> a container in `--to`'s layout."""
    from kvabi.abi.convert import convert
    from kvabi.cache.block_hasher import BlockHasher
    from kvabi.cli.containers import destination_for
    from kvabi.wire import write_container

    if not (args.tokens and args.model):
        raise KvabiError("from a vLLM offload folder: --tokens and --model are needed")
    model, ids = _model_spec(args.model), _token_ids(args.tokens)
    (base, ns), *rest = find_namespaces(args.input)
    if rest:
        raise KvabiError(f"{args.input}: {len(rest) + 1} namespaces; name one folder")
    got = read_offload(base.parent, ns, model, ids, args.page)
    dst = destination_for(
        got.cache.desc.model, args.to, args.block_size, args.dtype, got.num_tokens
    )
    out = convert(got.cache, dst, num_tokens=got.num_tokens)
    held = list(ids[: got.num_tokens])
    hashes = BlockHasher(model.compat_digest(), dst.layout.block_size).hashes(held)
    write_container(args.output, out, held, hashes)
    print(f"{base.name}: {len(got.paths)} files, {got.num_tokens} of {len(ids)} tokens -> "
          f"{args.output} [{args.to}]")  # fmt: skip
    return 0


def convert_to(args: argparse.Namespace, c: Container) -> int:
    """A container (`c`, already read and checked) -> offload files under `args.output`."""
    from kvabi.interop.vllm_offload import write_offload

    if not args.model_name:
        raise KvabiError("--to vllm-offload needs --model-name (the name vLLM knows it by)")
    desc = c.desc
    bs = args.block_size or desc.layout.block_size or 16
    dtype = {v: k for k, v in DTYPES.items()}.get(args.dtype or desc.layout.dtype)
    if dtype is None:
        raise KvabiError(f"dtype {desc.layout.dtype}: vLLM offload files hold {sorted(DTYPES)}")
    names = tuple(args.layer_names.format(i) for i in range(desc.model.num_layers))
    ns = OffloadNamespace(args.model_name, dtype, args.tokens_per_hash or bs,
                          (OffloadGroup(bs, names),), args.blocks_per_file,
                          args.offload_format)  # fmt: skip
    paths = write_offload(args.output, ns, c.cache, list(c.token_ids), args.page)
    print(f"{args.input} -> {ns.base_path(args.output)}: {len(paths)} files of "
          f"{ns.tokens_per_file} tokens ({ns.canonical_format}, {args.page})")  # fmt: skip
    return 0


def _is_mapper_config(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and {"model_name", "kv_cache_groups", "tokens_per_hash"} <= set(
        data
    )


def _files(base: Path) -> list[Path]:
    return sorted(base.parent.glob(f"{base.name}_r*/*/*_g*/*.bin"))


def _token_ids(path: str) -> list[int]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list) or not all(isinstance(t, int) and t >= 0 for t in data):
        raise KvabiError(f"--tokens {path}: a JSON array of token ids is needed")
    return data


def _model_spec(model: str) -> ModelSpec:
    """`model`'s cache geometry and fingerprint, K in HF's `half` order (as vLLM keeps it)."""
    from kvabi.interop.model_spec import model_spec_from_gguf
    from kvabi.models.registry import resolve_model

    source = resolve_model(model)
    if source.format != "gguf":
        raise KvabiError(f"--model {model}: a GGUF file or a bundled model name")
    return model_spec_from_gguf(source.path, rope_pairing="half")
