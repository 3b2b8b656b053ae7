"""vLLM's CPU_ATTN KV cache <-> kvabi `CacheBuffers` (presets `vllm-cpu-vec`, `vllm-cpu-amx`).

vLLM 0.32.0 on CPU keeps one tensor per attention layer, `[num_blocks, H, block_size, 2 * D]`,
whose (block, head) slab holds the K half then the V half, packed by the ISA its metadata
builder picked (`layer.isa`). That tensor is, byte for byte, the preset's buffer
`[num_blocks, H, 2, block_size * D]`: the adapter only re-views it (no copy). Block 0 is
vLLM's null block and never holds a sequence's KV. vllm itself is never imported here: the
caller hands over the tensors (kvabi/connectors/vllm_kv_worker.py runs inside vLLM's process).

Hybrid models (Gemma 3: sliding-window and full layers): vLLM's hybrid KV cache manager puts
layers of one kind into KV cache groups of equal size, each with its own block table per request;
one group's layers share their tensors' memory with the other groups' (a block id belongs to one
group at a time). A sliding group's table holds the null block where the window moved on. The
`*_group_sequence` functions take one table per layer (its group's) and move only the blocks a
layer needs (`needed_blocks`); a needed block that is null is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import TORCH_DTYPES
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.kv_groups import window_start
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import InteropError, ModelMismatchError, UnsupportedTypeError

ISA_PRESETS = {"vec": "vllm-cpu-vec", "amx": "vllm-cpu-amx"}  # isa -> preset
DTYPE_NAMES = {TORCH_DTYPES[n]: n for n in ("f32", "f16", "bf16")}
NULL_BLOCK = 0  # vLLM's placeholder block: block tables never name it


def vllm_cpu_descriptor(
    model: ModelSpec, isa: str, dtype: torch.dtype, block_size: int = 128
) -> Descriptor:
    """The descriptor of vLLM's CPU cache for `model`, given the layers' ISA and dtype."""
    if isa not in ISA_PRESETS:
        raise UnsupportedTypeError(
            f"vLLM CPU isa {isa!r} has no preset (known: {sorted(ISA_PRESETS)})"
        )
    if dtype not in DTYPE_NAMES:
        raise UnsupportedTypeError(f"vLLM CPU cache dtype {dtype} (fp8 caches are not mapped)")
    return preset_descriptor(
        ISA_PRESETS[isa], model, dtype=DTYPE_NAMES[dtype], block_size=block_size
    )


def kv_caches_to_buffers(
    kv_caches: Sequence[torch.Tensor], model: ModelSpec, isa: str
) -> CacheBuffers:
    """vLLM's per-layer caches (layer order) as kvabi buffers viewing the same memory."""
    if len(kv_caches) != model.num_layers:
        raise ModelMismatchError(f"{len(kv_caches)} cache tensors for {model.num_layers} layers")
    first = kv_caches[0]
    if first.dim() != 4:
        raise InteropError(f"expected [num_blocks, H, block_size, 2D], got {list(first.shape)}")
    num_blocks, heads, block_size, width = first.shape
    desc = vllm_cpu_descriptor(model, isa, first.dtype, block_size)
    tensors = {  # [num_blocks, H, 2, block_size * D]: the K half, then the V half
        str(i): t.view(num_blocks, heads, 2, block_size * width // 2)
        for i, t in enumerate(kv_caches)
    }
    return CacheBuffers(desc, tensors)


def check_block_ids(block_ids: Sequence[int]) -> None:
    """Refuse vLLM's null block in a sequence's block table (it never holds real KV)."""
    if NULL_BLOCK in block_ids:
        raise InteropError(f"block {NULL_BLOCK} is vLLM's null block; it holds no sequence's KV")


def read_sequence(cache: CacheBuffers, block_ids: Sequence[int], num_tokens: int) -> CacheBuffers:
    """A copy of one sequence's first `num_tokens` tokens, in vLLM's layout, blocks 0, 1, ..."""
    check_block_ids(block_ids)
    return convert(cache, cache.desc, num_tokens=num_tokens, src_block_ids=block_ids)


def write_sequence(
    src: CacheBuffers, cache: CacheBuffers, block_ids: Sequence[int], num_tokens: int,
    layer_ids: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Place `src`'s first `num_tokens` tokens (any layout of the model) into vLLM's blocks
    (`layer_ids`' layers only, if given)."""
    check_block_ids(block_ids)
    convert(src, cache.desc, num_tokens=num_tokens, dst_block_ids=block_ids, out=cache,
            layer_ids=layer_ids)  # fmt: skip


def needed_blocks(window: int, num_tokens: int, block_size: int) -> range:
    """The blocks of a sequence of `num_tokens` tokens a layer of `window` (0: full attention)
    needs for the next query (vLLM's hybrid rule, docs/ABI.md 2.5)."""
    return range(window_start(window, num_tokens) // block_size, -(-num_tokens // block_size))


def _layer_ids(
    cache: CacheBuffers, tables: Sequence[Sequence[int]], num_tokens: int
) -> Iterator[tuple[str, torch.Tensor, range, list[int]]]:
    """Per layer: (key, tensor, the block indices it needs, its block ids), checked: the table
    covers the sequence and no needed block is vLLM's null block (a sliding group's table holds
    the null block where the window moved on; a needed one there means the KV is gone)."""
    layers = cache.desc.model.layers
    if len(tables) != len(layers):
        raise ModelMismatchError(f"{len(tables)} block tables for {len(layers)} layers")
    bs = cache.desc.layout.block_size
    for i, (spec, table) in enumerate(zip(layers, tables, strict=True)):
        blocks = needed_blocks(spec.window, num_tokens, bs)
        if len(table) < blocks.stop:
            raise InteropError(
                f"layer {i}: a table of {len(table)} blocks for {num_tokens} tokens "
                f"({blocks.stop} blocks of {bs})"
            )
        if any(table[j] == NULL_BLOCK for j in blocks):
            j = next(j for j in blocks if table[j] == NULL_BLOCK)
            raise InteropError(
                f"layer {i} (window {spec.window}): block {j}, which a sequence of {num_tokens} "
                f"tokens needs, is vLLM's null block (freed): its KV is not there"
            )
        yield str(i), cache.tensors[str(i)], blocks, [table[j] for j in blocks]


def read_group_sequence(
    cache: CacheBuffers, tables: Sequence[Sequence[int]], num_tokens: int
) -> CacheBuffers:
    """One sequence of a hybrid cache (each layer's blocks in its own KV cache group's table,
    `tables[layer]`) as a copy in vLLM's layout, blocks 0, 1, ...: every block a layer needs
    (a sliding layer: its window's), zeros where its window no longer reaches."""
    num_blocks = -(-num_tokens // cache.desc.layout.block_size)
    out = {}
    for key, tensor, blocks, ids in _layer_ids(cache, tables, num_tokens):
        seq = torch.zeros((num_blocks, *tensor.shape[1:]), dtype=tensor.dtype)
        seq[blocks.start :] = tensor[torch.tensor(ids, dtype=torch.long)]
        out[key] = seq
    return CacheBuffers(cache.desc, out)


def write_group_sequence(
    src: CacheBuffers, cache: CacheBuffers, tables: Sequence[Sequence[int]], num_tokens: int
) -> None:
    """Place `src`'s first `num_tokens` tokens (any layout of the model) into a hybrid vLLM
    cache, each layer into its group's blocks `tables[layer]`: only the blocks the layer needs
    (a sliding layer's window; the blocks before it may be cached for shorter prefixes and are
    left as they are). Slots past `num_tokens` in its last block become zeros."""
    num_blocks = -(-num_tokens // cache.desc.layout.block_size)
    staged = convert(  # vLLM's layout, blocks 0, 1, ...; zeros past the last token
        src,
        cache.desc,
        num_tokens=num_tokens,
        out=CacheBuffers.empty(cache.desc, num_blocks, "zeros"),
    )
    for key, tensor, blocks, ids in _layer_ids(cache, tables, num_tokens):
        tensor[torch.tensor(ids, dtype=torch.long)] = staged.tensors[key][blocks.start :]


def store_ratio(vllm_block_size: int, store: Descriptor) -> int:
    """How many store blocks make one vLLM block; refuses block sizes that do not tile."""
    if not store.layout.is_paged:
        raise IncompatibleError("the store's descriptor must be paged (one entry per block)")
    bs = store.layout.block_size
    if vllm_block_size % bs:
        raise IncompatibleError(
            f"vLLM's block size {vllm_block_size} is not a multiple of the store's block size "
            f"{bs}: a vLLM block would split store entries (use a store block size dividing it)"
        )
    return vllm_block_size // bs
