"""LMCache EncodedKV blobs as kvabi buffers, and back (docs/PEERS.md, "LMCache EncodedKV").

A blob holds one layer; kvabi reads its K and V payloads as `[tokens, kv_head_count,
head_dim]` (LMCache's codec default, head axis -2, kv_layout "" or "NHD") into a one-layer
cache of layout `THC`. V stored as fp8 is dequantised as LMCache does (`q.float() * scale`,
then K's dtype); writing quantises V as LMCache's `AsymK16V8Codec` with a per-tensor scale.
"""

from __future__ import annotations

import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.codec import TORCH_DTYPES
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.layout import Layout
from kvabi.interop.errors import BlobDtypeError, BlobShapeError, BlobVersionError
from kvabi.interop.lmcache_blob import (
    IDENTITY_KEYS,
    INT_TO_DTYPE,
    SCALE_SCOPES,
    BlobHeader,
    EncodedBlob,
    dtype_id,
)

LAYOUT_NAME = "lmcache-encoded-kv"
TOKEN_MAJOR = ("", "NHD")  # kv_layout strings whose payload is [tokens, heads, head_dim]
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
ZERO_SCALE = 1.0  # LMCache's scale of an all-zero V
KVABI_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


def blob_descriptor(h: BlobHeader, fingerprint: str = "") -> Descriptor:
    """The one-layer kvabi descriptor of a blob's K/V (dtype K's, layout `THC`)."""
    if h.kv_head_count < 1 or h.head_dim < 1:
        raise BlobShapeError(f"kv_head_count {h.kv_head_count}, head_dim {h.head_dim}: unset")
    k_dtype = INT_TO_DTYPE[h.k_dtype_id]
    if k_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise BlobDtypeError(f"K dtype {k_dtype}: kvabi reads f16, bf16 or f32 K")
    layer = LayerSpec(ATTN, h.kv_head_count, h.head_dim, h.head_dim)
    model = ModelSpec(layers=(layer,), fingerprint=fingerprint)
    layout = Layout(axes="THC", block_size=0, dtype=KVABI_DTYPES[k_dtype], planes="separate",
                    name=LAYOUT_NAME)  # fmt: skip
    return Descriptor(model, layout)


def blob_buffers(blob: EncodedBlob, fingerprint: str = "") -> CacheBuffers:
    """A blob's K and V (V dequantised) as a one-layer kvabi cache, `[tokens, H, D]` each."""
    h = blob.header
    if h.ident("kv_layout") not in TOKEN_MAJOR:
        raise BlobShapeError(f"kv_layout {h.ident('kv_layout')!r}: kvabi reads {TOKEN_MAJOR}")
    desc = blob_descriptor(h, fingerprint)
    k, v, scales = blob.tensors()
    row = h.kv_head_count * h.head_dim
    if k.numel() != v.numel() or k.numel() % row:
        raise BlobShapeError(f"K {k.numel()} / V {v.numel()} elements: not tokens x {row}")
    shape = (k.numel() // row, h.kv_head_count, h.head_dim)  # [tokens, heads, head_dim]
    v = _dequantise(v.reshape(shape), scales, h, k.dtype)
    return CacheBuffers(desc, {"0.k": k.reshape(shape).clone(), "0.v": v})


def blob_from_buffers(
    cache: CacheBuffers, num_tokens: int, layer: int = 0, identity: dict[str, str] | None = None
) -> EncodedBlob:
    """Layer `layer` of a kvabi cache as an LMCache AsymK16V8 blob (fp8 V, per-tensor scale).

    K keeps an f16/bf16/f32 dtype (a quantised cache's K is written as bf16); `identity` sets
    LMCache's identity strings (unknown keys are refused)."""
    src = cache.desc.model.layers[layer]
    if src.kind != ATTN or src.k_dim != src.v_dim:
        raise BlobShapeError(f"layer {layer} ({src.kind}): a blob holds attention K/V of one D")
    model = ModelSpec(layers=cache.desc.model.layers, fingerprint=cache.desc.model.fingerprint)
    unknown = set(identity or {}) - set(IDENTITY_KEYS)
    if unknown:
        raise BlobShapeError(f"identity keys {sorted(unknown)}: LMCache writes {IDENTITY_KEYS}")
    stored = cache.desc.layout.dtype
    dtype = stored if stored in ("f16", "bf16", "f32") else "bf16"  # quantised K: as bf16
    thc = Descriptor(model, Layout("THC", 0, dtype, planes="separate", name=LAYOUT_NAME))
    out = convert(cache, thc, num_tokens=num_tokens)
    k, v = out.tensors[f"{layer}.k"], out.tensors[f"{layer}.v"]  # [tokens, H, D]
    scale = _per_tensor_scale(v)
    q = torch.clamp(v.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    payload = [_raw(t) for t in (k, q, scale)]
    names = dict.fromkeys(IDENTITY_KEYS, "") | (identity or {})
    header = BlobHeader(
        scale_scope=SCALE_SCOPES.index("per_tensor"),
        k_dtype_id=dtype_id(k.dtype),
        layer_id=layer,
        kv_head_count=src.num_kv_heads,
        head_dim=src.k_dim,
        k_len=len(payload[0]),
        v_len=len(payload[1]),
        scale_len=len(payload[2]),
        identity=tuple((key, names[key]) for key in IDENTITY_KEYS),
    )
    return EncodedBlob(header, b"".join(payload))


def _dequantise(
    v: torch.Tensor, scales: torch.Tensor, h: BlobHeader, dtype: torch.dtype
) -> torch.Tensor:
    if v.dtype == dtype:
        return v.clone()
    if v.dtype != torch.float8_e4m3fn:
        raise BlobDtypeError(f"V dtype {v.dtype}: kvabi reads K's dtype or fp8 e4m3 V")
    scope = SCALE_SCOPES[h.scale_scope]
    if scope == "per_tensor" and scales.numel() == 1:
        s = scales.float().reshape(())
    elif scope == "per_layer_head" and tuple(scales.shape) == (h.kv_head_count,):
        s = scales.float().view(1, h.kv_head_count, 1)
    else:
        raise BlobVersionError(f"scale scope {scope} with scales {tuple(scales.shape)}")
    return (v.float() * s).to(dtype)


def _per_tensor_scale(v: torch.Tensor) -> torch.Tensor:
    amax = v.float().abs().amax()
    return torch.where(amax > 0, amax / FP8_MAX, torch.tensor(ZERO_SCALE)).reshape(())


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
