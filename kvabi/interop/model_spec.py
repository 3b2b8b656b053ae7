"""Build a kvabi `ModelSpec` from what an engine loads: an HF config or a GGUF file.

Fingerprints (the `ModelSpec.fingerprint` string; equal fingerprints mean equal weights):

- `gguf-sha256:<64 hex>` (`gguf_fingerprint`): SHA-256 over the GGUF's tensors in ascending
  name order (UTF-8 byte order); for each, the UTF-8 name, one NUL byte, the ggml type as u32,
  the number of dims as u32, each dim (ggml order, ne0 first) as u64, the data length as u64,
  then the tensor's data bytes exactly as stored. All integers little-endian. Metadata
  (tokenizer, chat template, names) is left out, so re-labelling a file keeps its fingerprint.
  Whichever engine loads the file (llama.cpp, or transformers with `gguf_file=`), use this one.
- `hf-sha256:<64 hex>` (`state_dict_fingerprint`): SHA-256 over an HF model's state dict in
  ascending name order; for each, the UTF-8 name, NUL, the dtype name (`float32`, ...) and NUL,
  the number of dims as u32, each dim as u64, then the contiguous tensor bytes (little-endian
  host). For models that do not come from a GGUF.

Both can be overridden by passing `fingerprint=` explicitly.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvabi.abi.descriptor import MLA, LayerSpec, ModelSpec
from kvabi.interop.errors import InteropError, ModelMismatchError

# llama.cpp rope type per GGUF arch (llama_model_rope_type). NORM archs whose HF->GGUF converter
# permutes the Q/K rows store K in `pairs` order; NEOX archs keep HF's `half` order. Other
# archs (partial rotary, MLA, ISWA, converters that do not permute) need an explicit pairing.
NORM_PERMUTED_ARCHS = frozenset({"llama", "deci", "granite", "granitemoe"})
NEOX_ARCHS = frozenset(
    {
        "qwen2",
        "qwen2moe",
        "qwen3",
        "qwen3moe",
        "stablelm",
        "gptneox",
        "falcon",
        "olmo2",
        "starcoder2",
        "gemma3",
    }
)
# llama.cpp's iSWA archs: the default sliding-window pattern (layer il slides unless
# il % n == n - 1), used when the GGUF has no `attention.sliding_window_pattern`.
SWA_PATTERN_ARCHS = {"gemma3": 6}


def gguf_fingerprint(source: str | Path | Any) -> str:
    """`gguf-sha256:` fingerprint of a GGUF file's tensors (see the module docstring).

    `source`: a path or an open `gguf.GGUFReader` (opening one parses all metadata: seconds).
    """
    reader = _reader(source)
    digest = hashlib.sha256()
    for t in sorted(reader.tensors, key=lambda x: x.name.encode()):
        dims = [int(d) for d in t.shape]
        data = memoryview(t.data).cast("B")
        digest.update(t.name.encode() + b"\0" + struct.pack("<II", int(t.tensor_type), len(dims)))
        digest.update(struct.pack(f"<{len(dims)}QQ", *dims, len(data)))
        digest.update(data)
    return "gguf-sha256:" + digest.hexdigest()


def state_dict_fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """`hf-sha256:` fingerprint of a state dict (see the module docstring)."""
    digest = hashlib.sha256()
    for name in sorted(state_dict, key=str.encode):
        t = state_dict[name].detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        digest.update(f"{name}\0{dtype}\0".encode() + struct.pack("<I", t.dim()))
        digest.update(struct.pack(f"<{t.dim()}Q", *t.shape))
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "hf-sha256:" + digest.hexdigest()


def model_spec_from_hf_config(
    config: Any, fingerprint: str = "", rope_pairing: str = "half"
) -> ModelSpec:
    """The cache an HF model with this config holds: K after RoPE, in HF's `half` order.

    Layers are full attention or sliding (`swa`, with HF's `sliding_window`: a query sees that
    many keys, itself included), as HF's own `DynamicCache` builds them from the config; other
    layer types are refused. A config with `kv_lora_rank` (DeepSeek-V3) caches MLA latents.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(cfg, "kv_lora_rank", None):
        return _mla_model_spec(cfg, fingerprint, rope_pairing)
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    factor = getattr(cfg, "partial_rotary_factor", 1.0) or 1.0
    rope_dim = 0 if factor >= 1.0 else int(head_dim * factor)
    return ModelSpec(
        layers=tuple(
            LayerSpec(num_kv_heads=num_kv_heads, k_dim=head_dim, v_dim=head_dim, window=w)
            for w in _hf_layer_windows(cfg)
        ),
        fingerprint=fingerprint,
        rope_pairing=rope_pairing,
        rope_dim=rope_dim,
    )


def _mla_model_spec(cfg: Any, fingerprint: str, rope_pairing: str) -> ModelSpec:
    """DeepSeek-V3's MLA cache: per layer the latent c_kv (after kv_a_layernorm) and k_pe after
    RoPE, in `half` order (HF de-interleaves `rope_interleave` models before rotating); V3.2's
    also its indexer key per token (the sidecar plane `indexer`, `index_head_dim` wide). Other
    latent models cache otherwise (V2: expanded keys) and are refused rather than mapped short
    of a plane."""
    if cfg.model_type not in ("deepseek_v3", "deepseek_v32"):
        raise InteropError(
            f"model_type {cfg.model_type!r}: of the latent-attention models only DeepSeek-V3's "
            "and V3.2's HF caches (c_kv, k_pe per layer; V3.2 its indexer keys too) are mapped"
        )
    indexer_dim = cfg.index_head_dim if cfg.model_type == "deepseek_v32" else 0
    layer = LayerSpec(
        MLA, latent_dim=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, indexer_dim=indexer_dim
    )
    return ModelSpec((layer,) * cfg.num_hidden_layers, fingerprint, rope_pairing=rope_pairing)


def _hf_layer_windows(cfg: Any) -> list[int]:
    """Each layer's window (0: full attention) as HF's DynamicCache reads the config."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise InteropError(f"{len(types)} layer types for {cfg.num_hidden_layers} layers")
    if "sliding_attention" in types:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(cfg)
    else:
        kwargs = [{}] * len(types)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise InteropError(
            f"layer types {unknown}: only full_attention and sliding_attention layers are mapped"
        )
    windows = [int(kw.get("sliding_window") or 0) for kw in kwargs]
    if any(w < 1 for w, t in zip(windows, types, strict=True) if t == "sliding_attention"):
        raise InteropError(f"sliding layers without a sliding_window > 0: {windows}")
    return windows


def model_spec_from_gguf(
    source: str | Path | Any, fingerprint: str | None = None, rope_pairing: str | None = None
) -> ModelSpec:
    """The cache llama.cpp holds for this GGUF model (K after RoPE, in llama.cpp's order).

    `source`: a path or an open `gguf.GGUFReader`. `fingerprint=None` computes
    `gguf_fingerprint`. Geometry as in `model_spec_from_gguf_metadata`.
    """
    reader = _reader(source)
    arch = str(reader.get_field("general.architecture").contents())
    meta = {"general.architecture": arch} | {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith(f"{arch}.")
    }
    return model_spec_from_gguf_metadata(
        meta, gguf_fingerprint(reader) if fingerprint is None else fingerprint, rope_pairing
    )


def model_spec_from_llama(
    llm: Any, fingerprint: str | None = None, rope_pairing: str | None = None
) -> ModelSpec:
    """The same for a loaded `llama_cpp.Llama` (its metadata; no second parse of the file).

    `fingerprint=None` hashes the model file (`gguf_fingerprint(llm.model_path)`: seconds).
    """
    fp = gguf_fingerprint(llm.model_path) if fingerprint is None else fingerprint
    return model_spec_from_gguf_metadata(llm.metadata, fp, rope_pairing)


def model_spec_from_gguf_metadata(
    meta: Mapping[str, Any], fingerprint: str, rope_pairing: str | None = None
) -> ModelSpec:
    """A llama.cpp cache's geometry from GGUF metadata (values typed, or strings as
    llama.cpp's `llama_model_meta_val_str` gives them).

    Layers: `{arch}.block_count`; KV heads: `{arch}.attention.head_count_kv` (scalar or
    per layer; default head_count); K/V dims: `attention.key_length` / `value_length` (default
    embedding_length / head_count); rope_dim: `rope.dimension_count` (0 when it is the whole
    head). `rope_pairing=None` takes it from the arch (NORM_PERMUTED_ARCHS -> pairs,
    NEOX_ARCHS -> half, others refused).
    """
    arch = str(meta["general.architecture"])
    pairing = rope_pairing or _arch_pairing(arch)

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelMismatchError(f"GGUF metadata has no {arch}.{key}")
        return value

    num_layers, num_heads = int(get("block_count")), int(get("attention.head_count"))
    k_dim = int(get("attention.key_length", int(get("embedding_length")) // num_heads))
    v_dim = int(get("attention.value_length", k_dim))
    heads = get("attention.head_count_kv", num_heads)
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * num_layers
    if len(heads) != num_layers or min(heads) < 1:
        raise InteropError(f"per-layer KV heads {heads}: layers without KV are not mapped")
    rope_dim = int(get("rope.dimension_count", k_dim))
    windows = _gguf_windows(arch, meta, num_layers)
    return ModelSpec(
        layers=tuple(
            LayerSpec(num_kv_heads=h, k_dim=k_dim, v_dim=v_dim, window=w)
            for h, w in zip(heads, windows, strict=True)
        ),
        fingerprint=fingerprint,
        rope_pairing=pairing,
        rope_dim=0 if rope_dim == k_dim else rope_dim,
    )


def _gguf_windows(arch: str, meta: Mapping[str, Any], num_layers: int) -> list[int]:
    """Each layer's window as llama.cpp's iSWA archs set it (`load_swa_pattern`)."""
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if arch not in SWA_PATTERN_ARCHS or window <= 0:
        return [0] * num_layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", SWA_PATTERN_ARCHS[arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise InteropError(
                f"sliding_window_pattern has {len(pattern)} entries, not {num_layers}"
            )
        return [window if is_swa else 0 for is_swa in pattern]
    if isinstance(pattern, str) and not pattern.isdigit():
        raise InteropError(
            f"sliding_window_pattern {pattern[:40]!r}: read per-layer patterns from the GGUF "
            "(model_spec_from_gguf)"
        )
    n = int(pattern)
    return [window if n == 0 or i % n < n - 1 else 0 for i in range(num_layers)]


def _reader(source: str | Path | Any) -> Any:
    from gguf import GGUFReader

    return source if isinstance(source, GGUFReader) else GGUFReader(str(source))


def _arch_pairing(arch: str) -> str:
    if arch in NORM_PERMUTED_ARCHS:
        return "pairs"
    if arch in NEOX_ARCHS:
        return "half"
    raise InteropError(f"GGUF arch {arch!r}: K's RoPE order is not known here; pass rope_pairing")
