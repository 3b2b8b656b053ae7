"""A tiny `KVCache` for control-plane tests: real ids, hashes and storage, hardly any bytes."""

from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.kv_cache import KVCache

MODEL = ModelSpec((LayerSpec(ATTN, 1, 8, 8),), "tiny-cache")


def tiny_cache(
    num_blocks: int, block_size: int = 4, layout: str = "vllm-flash-attn", **kwargs
) -> KVCache:
    desc = preset_descriptor(layout, MODEL, block_size=block_size, dtype="f32")
    return KVCache(desc, num_blocks, **kwargs)
