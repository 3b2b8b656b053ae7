"""Model geometries people plan KV memory for, as ModelSpecs (from each model's config.json)."""

from __future__ import annotations

from kvabi.abi.descriptor import ATTN, MLA, LayerSpec, ModelSpec

_GQA = {  # name: (layers, kv heads, head dim)
    "llama-3-8b": (32, 8, 128),
    "llama-3-70b": (80, 8, 128),
    "llama-3.1-405b": (126, 8, 128),
    "llama-2-7b": (32, 32, 128),
    "llama-2-70b": (80, 8, 128),
    "mistral-7b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "qwen2-72b": (80, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
_MLA = {"deepseek-v3": (61, 512, 64)}  # layers, kv_lora_rank, qk_rope_head_dim
_VOCAB = {  # config.json vocab_size
    "llama-3-8b": 128256,
    "llama-3-70b": 128256,
    "llama-3.1-405b": 128256,
    "llama-2-7b": 32000,
    "llama-2-70b": 32000,
    "mistral-7b": 32000,
    "qwen2-7b": 152064,
    "qwen2-72b": 152064,
    "smollm2-135m": 49152,
    "deepseek-v3": 129280,
}


def catalog_model(name: str) -> ModelSpec:
    """The ModelSpec of a known model by name (see `MODEL_NAMES`)."""
    key = name.lower()
    if key in _GQA:
        layers, heads, dim = _GQA[key]
        return ModelSpec((LayerSpec(ATTN, heads, dim, dim),) * layers, fingerprint=key)
    if key in _MLA:
        layers, rank, rope = _MLA[key]
        return ModelSpec((LayerSpec(MLA, latent_dim=rank, rope_dim=rope),) * layers, key)
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def catalog_vocab_size(fingerprint: str) -> int | None:
    """The vocabulary size of the catalog model a fingerprint names (catalog descriptors use
    the name as fingerprint), or None for any other fingerprint."""
    return _VOCAB.get(fingerprint)


MODEL_NAMES = tuple(_GQA) + tuple(_MLA)
