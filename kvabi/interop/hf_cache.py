"""HF transformers `DynamicCache` <-> kvabi `CacheBuffers` (preset `hf-dynamic`).

A `DynamicLayer` holds keys and values `[batch, num_kv_heads, seq_len, head_dim]`, post-RoPE K
in HF's `half` order, token t at position t. One batch row is one sequence; `hf-dynamic` is its
`[H, T, D]` view per layer and plane (buffer keys `'{layer}.k'`, `'{layer}.v'`). transformers is
imported lazily: this module loads without it.

Sliding-window models (Gemma 3): HF's `DynamicSlidingWindowLayer` of window W keeps only the
last W - 1 tokens, what the next query attends to besides itself. As kvabi buffers every layer
has the full extent of n tokens; a sliding layer's positions max(0, n - W + 1) .. n - 1 carry
its KV and the positions before are zeros (kvabi's convention for a hybrid cache in one
sequence's buffers, sliding.py).

MLA models (DeepSeek-V3): HF caches the latents in the same `DynamicLayer`s, keys = c_kv after
`kv_a_layernorm` `[batch, 1, T, kv_lora_rank]`, values = k_pe after RoPE `[batch, 1, T, rope]`;
preset `hf-dynamic-mla`, buffer keys `'{layer}.latent'`, `'{layer}.rope'`. Every layer's shapes
are checked against the model's planes, so an attention cache offered as MLA, or the reverse,
is refused before any byte is read as KV.

DeepSeek V3.2: each layer (`DynamicIndexedLayer`) also keeps its indexer keys
`[batch, T, index_head_dim]` (post-RoPE, unquantised, the model's dtype); kvabi's sidecar plane
`indexer` holds them as vLLM does, fp8 e4m3 with a float32 scale per token
(`kvabi/abi/indexer_record.py`). So HF -> kvabi rounds each key as vLLM's writer would (what the
kvabi engine stores of the same key), kvabi -> HF gives the dequantised keys in the cache's
dtype: a round trip returns fp8's rounding of the keys, not the keys. A layer that lacks the
indexer keys its model declares, or holds keys its model does not, is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import TORCH_DTYPES
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import MLA, LayerSpec, ModelSpec
from kvabi.abi.errors import MissingPlaneError
from kvabi.abi.indexer_record import decode_blocks, encode_blocks
from kvabi.abi.kv_groups import window_start
from kvabi.abi.presets import preset_descriptor
from kvabi.interop.errors import InteropError, ModelMismatchError, UnsupportedTypeError
from kvabi.interop.model_spec import model_spec_from_hf_config
from kvabi.interop.sliding import check_windows_held

FLOAT_DTYPES = {TORCH_DTYPES[n]: n for n in ("f32", "f16", "bf16")}


def dynamic_cache_to_buffers(cache: Any, model: ModelSpec, batch_index: int = 0) -> CacheBuffers:
    """Row `batch_index` of an HF `DynamicCache` as `hf-dynamic` buffers.

    Full-attention layers' buffers are views of the cache's tensors when those are on the CPU
    and contiguous (a `DynamicLayer` replaces its tensors when it grows, so the views stay
    valid); otherwise copies. A sliding layer becomes a zero-padded copy (module docstring).

    `model` describes the HF model's cache (`model_spec_from_hf_config`): its pairing is the
    order HF keeps K in (`half` for Llama-family models) and its windows are the layers'. The
    dtype is the cache's own. Raises ModelMismatchError when the cache's layers are not the
    model's (count, sliding or not, window), InteropError when the layers disagree on the
    number of tokens or a sliding layer holds fewer than its window needs.
    """
    layers = list(cache.layers)
    if len(layers) != model.num_layers:
        raise ModelMismatchError(
            f"the cache has {len(layers)} layers, the model {model.num_layers}"
        )
    num_tokens = _num_tokens(layers, model)
    tensors: dict[str, torch.Tensor] = {}
    for i, (layer, spec) in enumerate(zip(layers, model.layers, strict=True)):
        held_planes = (layer.keys, layer.values)
        _check_planes(held_planes, spec, i)
        for plane, held in zip(spec.planes, held_planes, strict=True):
            row = held[batch_index].detach()  # [H, T_held, D]
            if spec.window:
                row = _pad_window(row, num_tokens, spec.window, i)
            tensors[f"{i}.{plane.name}"] = row.cpu().contiguous()  # [H, T, D]
        tensors |= _indexer_records(layer, spec, i, batch_index)
    dtype = _dtype_name(next(iter(tensors.values())).dtype)
    return CacheBuffers(preset_descriptor(hf_preset(model), model, dtype=dtype), tensors)


def hf_preset(model: ModelSpec) -> str:
    """The preset of HF's cache for `model`: `hf-dynamic-mla` for MLA, else `hf-dynamic`."""
    return "hf-dynamic-mla" if model.layers[0].kind == MLA else "hf-dynamic"


def _check_planes(held: tuple[torch.Tensor, torch.Tensor], spec: LayerSpec, layer_id: int) -> None:
    """Refuse a layer whose keys/values are not the model's planes: (heads, width) of K and V
    for attention, (1, kv_lora_rank) and (1, rope) for MLA."""
    want = [(p.num_heads, p.width) for p in spec.planes]
    got = [(t.shape[1], t.shape[-1]) if t.dim() == 4 else tuple(t.shape) for t in held]
    if got != want:
        raise ModelMismatchError(
            f"layer {layer_id}: the cache's keys and values are {got} (heads, width); the "
            f"model's {spec.kind} layer caches {want} ({', '.join(p.name for p in spec.planes)})"
        )


def _indexer_records(
    layer: Any, spec: LayerSpec, layer_id: int, batch_index: int
) -> dict[str, torch.Tensor]:
    """A V3.2 layer's indexer keys as the sidecar plane's records (u8 `[T, D + 4]`)."""
    keys = getattr(layer, "indexer_keys", None)
    held = keys is not None and keys.numel() > 0
    if not spec.sidecar_planes:
        if held:
            raise ModelMismatchError(
                f"layer {layer_id}: the cache holds indexer keys; the model's layer has no "
                "indexer plane (a V3.2 cache is not read as V3's)"
            )
        return {}
    (plane,) = spec.sidecar_planes
    if not held:
        raise MissingPlaneError(layer_id, plane.name, "the HF cache holds no indexer keys")
    row = keys[batch_index].detach()  # [T, D]
    if row.shape[-1] != plane.width or row.shape[0] != layer.keys.shape[-2]:
        raise ModelMismatchError(
            f"layer {layer_id}: indexer keys {list(row.shape)}; the model's plane is "
            f"{plane.width} wide, one key per cached token ({layer.keys.shape[-2]})"
        )
    return {f"{layer_id}.{plane.name}": encode_blocks(row.cpu(), 1)}  # [T, D + 4]


def _num_tokens(layers: list[Any], model: ModelSpec) -> int:
    """The sequence length every layer agrees on (a sliding layer counts what it has seen)."""
    from transformers.cache_utils import DynamicLayer

    counts = set()
    for i, (layer, spec) in enumerate(zip(layers, model.layers, strict=True)):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "keys", None) is None:
            raise InteropError(
                f"layer {i} is a {type(layer).__name__}; only filled DynamicLayers and "
                "DynamicSlidingWindowLayers map"
            )
        window = layer.sliding_window if getattr(layer, "is_sliding", False) else 0
        if window != spec.window:
            raise ModelMismatchError(
                f"layer {i}: the cache's window is {window}, the model's {spec.window} "
                "(0: full attention)"
            )
        counts.add(layer.cumulative_length if window else layer.keys.shape[-2])
    if len(counts) != 1:
        raise InteropError(f"the layers hold different numbers of tokens: {sorted(counts)}")
    return counts.pop()


def _pad_window(held: torch.Tensor, num_tokens: int, window: int, layer_id: int) -> torch.Tensor:
    """[H, T_held, D] of the last T_held positions -> [H, num_tokens, D], zeros before the
    window's first position max(0, num_tokens - window + 1)."""
    needed = num_tokens - window_start(window, num_tokens)
    if held.shape[1] < needed:
        raise InteropError(
            f"sliding layer {layer_id} holds {held.shape[1]} tokens; at position {num_tokens} "
            f"its window of {window} needs the last {needed}"
        )
    out = held.new_zeros(held.shape[0], num_tokens, held.shape[2])  # [H, T, D]
    if needed:
        out[:, num_tokens - needed :] = held[:, held.shape[1] - needed :]
    return out


def buffers_to_dynamic_cache(
    cache: CacheBuffers,
    config: Any,
    dtype: torch.dtype | None = None,
    num_tokens: int | None = None,
    block_ids: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> Any:
    """A `DynamicCache` (batch 1) holding the first `num_tokens` tokens of any kvabi cache.

    The cache converts to `hf-dynamic` (`hf-dynamic-mla`) for a model with `config` (K
    re-ordered to HF's pairing, values decoded, fp8_ds_mla records dequantised; V3.2's
    indexer keys dequantised into each layer's `indexer_keys`); `config`'s
    geometry, layer kinds and windows must match the cache's model. A sliding
    layer keeps exactly what HF keeps after a prefill of those tokens (the last window - 1).
    `dtype` defaults to the
    source's float dtype (float32 for a quantised source). A paged source needs `num_tokens`
    and, unless its blocks are 0, 1, ..., `block_ids`.
    """
    from transformers import DynamicCache

    src = cache.desc
    hf_model = model_spec_from_hf_config(config, fingerprint=src.model.fingerprint)
    if hf_model.layers != src.model.layers:
        raise ModelMismatchError(
            f"config geometry {_geometry(hf_model)} differs from the cache's {_geometry(src.model)}"
        )
    if dtype is None:
        dtype = TORCH_DTYPES[src.layout.dtype] if src.layout.quant == "none" else torch.float32
    if num_tokens is None:
        if src.layout.is_paged:
            raise InteropError(
                "a paged cache does not say how many tokens it holds: give num_tokens"
            )
        num_tokens = cache.extent
    dst = preset_descriptor(hf_preset(hf_model), hf_model, dtype=_dtype_name(dtype))
    out = convert(cache, dst, num_tokens=num_tokens, src_block_ids=block_ids)
    if dst.layout.name == "hf-dynamic":
        check_windows_held(out, num_tokens)
    pairs = [
        tuple(out.tensors[f"{i}.{p.name}"].unsqueeze(0).to(device) for p in spec.planes)
        for i, spec in enumerate(hf_model.layers)
    ]  # per layer (keys, values): [1, H, T, D]; MLA: c_kv [1, 1, T, rank], k_pe [1, 1, T, rope]
    # a DynamicSlidingWindowLayer fed all T tokens keeps the last window - 1 and counts T
    hf_cache = DynamicCache(pairs, config=config)
    for i, spec in enumerate(hf_model.layers):
        for plane in spec.sidecar_planes:  # V3.2: the indexer keys, dequantised
            keys = decode_blocks(out.tensors[f"{i}.{plane.name}"], plane.width)  # [T, D]
            hf_cache.layers[i].update_indexer(keys.to(dtype=dtype, device=device)[None])
    return hf_cache


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


def _geometry(model: ModelSpec) -> str:
    first = model.layers[0]
    if first.kind == MLA:
        return f"MLA {first.latent_dim}+{first.rope_dim} x{model.num_layers} layers"
    windows = sorted({x.window for x in model.layers})
    return f"{first.num_kv_heads}x{first.k_dim} x{model.num_layers} layers, windows {windows}"


def _dtype_name(dtype: torch.dtype) -> str:
    name = FLOAT_DTYPES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(f"{dtype}: an HF cache maps as float32, float16 or bfloat16")
    return name
