"""HF transformers `DynamicCache` <-> kvabi `CacheBuffers` (preset `hf-dynamic`).

A `DynamicLayer` holds keys and values `[batch, num_kv_heads, seq_len, head_dim]`, post-RoPE K
in HF's `half` order, token t at position t. One batch row is one sequence; `hf-dynamic` is its
`[H, T, D]` view per layer and plane (buffer keys `'{layer}.k'`, `'{layer}.v'`). transformers is
imported lazily: this module loads without it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import TORCH_DTYPES
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ModelSpec
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import InteropError, ModelMismatchError, UnsupportedTypeError
from kvabi.interop.model_spec import model_spec_from_hf_config

FLOAT_DTYPES = {TORCH_DTYPES[n]: n for n in ("f32", "f16", "bf16")}


def dynamic_cache_to_buffers(cache: Any, model: ModelSpec, batch_index: int = 0) -> CacheBuffers:
    """Row `batch_index` of an HF `DynamicCache` as `hf-dynamic` buffers.

    The buffers are views of the cache's tensors when those are on the CPU and contiguous
    (a `DynamicLayer` replaces its tensors when it grows, so the views stay valid); otherwise
    copies.

    `model` describes the HF model's cache (`model_spec_from_hf_config`): its pairing is the
    order HF keeps K in (`half` for Llama-family models). The dtype is the cache's own.
    """
    from transformers.cache_utils import DynamicLayer

    layers = list(cache.layers)
    if len(layers) != model.num_layers:
        raise ModelMismatchError(
            f"the cache has {len(layers)} layers, the model {model.num_layers}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        sliding = getattr(layer, "is_sliding", False)
        if not isinstance(layer, DynamicLayer) or sliding or getattr(layer, "keys", None) is None:
            raise InteropError(
                f"layer {i} is a {type(layer).__name__} (sliding: {sliding}); only filled "
                "full-attention DynamicLayers map"
            )
        tensors[f"{i}.k"] = layer.keys[batch_index].detach().cpu().contiguous()  # [H, T, D]
        tensors[f"{i}.v"] = layer.values[batch_index].detach().cpu().contiguous()  # [H, T, D]
    desc = preset_descriptor("hf-dynamic", model, dtype=_dtype_name(tensors["0.k"].dtype))
    return CacheBuffers(desc, tensors)


def buffers_to_dynamic_cache(
    cache: CacheBuffers,
    config: Any,
    dtype: torch.dtype | None = None,
    num_tokens: int | None = None,
    block_ids: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> Any:
    """A `DynamicCache` (batch 1) holding the first `num_tokens` tokens of any kvabi cache.

    The cache converts to `hf-dynamic` for a model with `config` (K re-ordered to HF's pairing,
    values decoded); `config`'s geometry must match the cache's model. `dtype` defaults to the
    source's float dtype (float32 for a quantised source). A paged source needs `num_tokens`
    and, unless its blocks are 0, 1, ..., `block_ids`.
    """
    from transformers import DynamicCache

    src = cache.desc
    hf_model = model_spec_from_hf_config(config, fingerprint=src.model.fingerprint)
    if hf_model.layers != src.model.layers:
        raise ModelMismatchError(
            f"config geometry {hf_model.layers[0]} x{hf_model.num_layers} "
            f"differs from the cache's {src.model.layers[0]} "
            f"x{src.model.num_layers}"
        )
    if dtype is None:
        dtype = TORCH_DTYPES[src.layout.dtype] if src.layout.quant == "none" else torch.float32
    if num_tokens is None:
        if src.layout.is_paged:
            raise InteropError(
                "a paged cache does not say how many tokens it holds: give num_tokens"
            )
        num_tokens = cache.extent
    dst = preset_descriptor("hf-dynamic", hf_model, dtype=_dtype_name(dtype))
    out = convert(cache, dst, num_tokens=num_tokens, src_block_ids=block_ids)
    pairs = [
        (
            out.tensors[f"{i}.k"].unsqueeze(0).to(device),  # [1, H, T, D]
            out.tensors[f"{i}.v"].unsqueeze(0).to(device),
        )
        for i in range(hf_model.num_layers)
    ]
    return DynamicCache(pairs, config=config)


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes the cache: `cache` (transformers >= 5.24) or
    `past_key_values` (earlier; deprecated from 5.24)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_with_cache(model: Any, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
    """`model(input_ids, <cache kwarg>=cache, use_cache=True)`, whichever name the model takes."""
    return model(input_ids=input_ids, use_cache=True, **{cache_kwarg(model): cache}, **kwargs)


def output_cache(outputs: Any) -> Any:
    """The cache a forward returned (`.cache` from 5.24, `.past_key_values` before)."""
    if "cache" in outputs:
        return outputs["cache"]
    return outputs["past_key_values"]


def _dtype_name(dtype: torch.dtype) -> str:
    name = FLOAT_DTYPES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(f"{dtype}: an HF cache maps as float32, float16 or bfloat16")
    return name
