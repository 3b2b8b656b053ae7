"""vLLM's CPU_ATTN KV cache <-> kvabi `CacheBuffers` (presets `vllm-cpu-vec`, `vllm-cpu-amx`).

vLLM 0.32.0 on CPU keeps one tensor per attention layer, `[num_blocks, H, block_size, 2 * D]`,
whose (block, head) slab holds the K half then the V half, packed by the ISA its metadata
builder picked (`layer.isa`). That tensor is, byte for byte, the preset's buffer
`[num_blocks, H, 2, block_size * D]`: the adapter only re-views it (no copy). Block 0 is
vLLM's null block and never holds a sequence's KV. vllm itself is never imported here: the
caller hands over the tensors (kvabi/connectors/vllm_kv_worker.py runs inside vLLM's process).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import TORCH_DTYPES
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor, ModelSpec
from kvabi.abi.errors import IncompatibleError
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
    src: CacheBuffers, cache: CacheBuffers, block_ids: Sequence[int], num_tokens: int
) -> None:
    """Place `src`'s first `num_tokens` tokens (any layout of the model) into vLLM's blocks."""
    check_block_ids(block_ids)
    convert(src, cache.desc, num_tokens=num_tokens, dst_block_ids=block_ids, out=cache)


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
