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

from kvabi.abi.descriptor import LayerSpec, ModelSpec
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
    }
)


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
    """The cache an HF model with this config holds: K after RoPE, in HF's `half` order."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise InteropError(f"layer types {sorted(kinds)}: only full-attention models are mapped")
    factor = getattr(cfg, "partial_rotary_factor", 1.0) or 1.0
    rope_dim = 0 if factor >= 1.0 else int(head_dim * factor)
    layer = LayerSpec(num_kv_heads=num_kv_heads, k_dim=head_dim, v_dim=head_dim)
    return ModelSpec(
        layers=(layer,) * cfg.num_hidden_layers,
        fingerprint=fingerprint,
        rope_pairing=rope_pairing,
        rope_dim=rope_dim,
    )


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
    return ModelSpec(
        layers=tuple(LayerSpec(num_kv_heads=h, k_dim=k_dim, v_dim=v_dim) for h in heads),
        fingerprint=fingerprint,
        rope_pairing=pairing,
        rope_dim=0 if rope_dim == k_dim else rope_dim,
    )


def _reader(source: str | Path | Any) -> Any:
    from gguf import GGUFReader

    return source if isinstance(source, GGUFReader) else GGUFReader(str(source))


def _arch_pairing(arch: str) -> str:
    if arch in NORM_PERMUTED_ARCHS:
        return "pairs"
    if arch in NEOX_ARCHS:
        return "half"
    raise InteropError(f"GGUF arch {arch!r}: K's RoPE order is not known here; pass rope_pairing")
