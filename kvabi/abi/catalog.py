"""Model geometries people plan KV memory for, as ModelSpecs (from each model's config.json)."""

from __future__ import annotations

from kvabi.abi.descriptor import ATTN, CENTRIES, MLA, LayerSpec, ModelSpec

_GQA = {  # name: (layers, kv heads, head dim, query heads)
    "llama-3-8b": (32, 8, 128, 32),
    "llama-3-70b": (80, 8, 128, 64),
    "llama-3.1-405b": (126, 8, 128, 128),
    "llama-2-7b": (32, 32, 128, 32),
    "llama-2-70b": (80, 8, 128, 64),
    "mistral-7b": (32, 8, 128, 32),
    "qwen2-7b": (28, 4, 128, 28),
    "qwen2-72b": (80, 8, 128, 64),
    "smollm2-135m": (30, 3, 64, 9),
}
_MLA = {"deepseek-v3": (61, 512, 64, 128)}  # layers, kv_lora_rank, qk_rope_head_dim, heads
# DeepSeek V4 (transformers 5.24's DeepseekV4Config defaults, its DeepSeek-V4-Flash-Base):
# layers, head_dim (the K=V row), index_head_dim, heads, sliding window, CSA m, HCA m'
_V4 = {"deepseek-v4-flash": (43, 512, 128, 64, 128, 4, 128)}
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
    "deepseek-v4-flash": 129280,
}


def catalog_model(name: str) -> ModelSpec:
    """The ModelSpec of a known model by name (see `MODEL_NAMES`)."""
    key = name.lower()
    if key in _GQA:
        layers, heads, dim, _ = _GQA[key]
        return ModelSpec((LayerSpec(ATTN, heads, dim, dim),) * layers, fingerprint=key)
    if key in _MLA:
        layers, rank, rope, _ = _MLA[key]
        return ModelSpec((LayerSpec(MLA, latent_dim=rank, rope_dim=rope),) * layers, key)
    if key in _V4:
        return ModelSpec(_v4_layers(*_V4[key]), key)
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def _v4_layers(
    n: int, dim: int, index_dim: int, _: int, window: int, csa: int, hca: int
) -> tuple[LayerSpec, ...]:
    """HF's default V4 schedule: two HCA layers, then CSA and HCA alternating; every layer's
    window of K=V rows, then each compressed layer's entries (as `DeepseekV4Config.kv_layers`)."""
    kinds = ["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]
    entries = tuple(
        LayerSpec(
            CENTRIES,
            latent_dim=dim,
            indexer_dim=index_dim if k == "csa" else 0,
            compresses=i,
            ratio=csa if k == "csa" else hca,
            overlap=k == "csa",
        )  # fmt: skip
        for i, k in enumerate(kinds)
    )
    return (LayerSpec(ATTN, 1, dim, dim, window=window),) * n + entries


def catalog_query_heads(name: str) -> int:
    """A catalog model's query heads (config.json `num_attention_heads`), every layer."""
    key = name.lower()
    if key not in _GQA and key not in _MLA and key not in _V4:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    return (_GQA | _MLA | _V4)[key][3]


def catalog_vocab_size(fingerprint: str) -> int | None:
    """The vocabulary size of the catalog model a fingerprint names (catalog descriptors use
    the name as fingerprint), or None for any other fingerprint."""
    return _VOCAB.get(fingerprint)


MODEL_NAMES = tuple(_GQA) + tuple(_MLA) + tuple(_V4)
