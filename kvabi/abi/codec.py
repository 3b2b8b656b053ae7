"""Element encodings: stored content <-> float32 values, per (token, head) vector.

A codec sees the content axis of one plane group (planes packed into C are encoded together,
as in DeepSeek's 656-byte record). Lossless codecs round-trip bit-exactly; each quantising
codec states its error bound (docs/ABI.md, tested in tests/abi/test_codec.py).
"""

from __future__ import annotations

import numpy as np
import torch

from kvabi.abi import ds_mla_record
from kvabi.abi.descriptor import GGML_QUANTS, Layout, Plane

TORCH_DTYPES = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "u8": torch.uint8,
}
GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
SCALE_BYTES = 4  # one float32 scale per (token, head) for per_token_head


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def stored_width(layout: Layout, planes: tuple[Plane, ...]) -> int:
    """Elements of the storage dtype that one (token, head) of these planes occupies."""
    width = sum(p.width for p in planes)
    if layout.quant == "per_token_head":
        return width + SCALE_BYTES  # storage dtypes here are one byte wide
    if layout.quant == "fp8_ds_mla":
        return ds_mla_record.RECORD_BYTES
    if layout.quant in GGML_QUANTS:
        return width // 32 * GGML_BLOCK_BYTES[layout.quant]
    return width


def is_lossless_pair(src: Layout, dst: Layout) -> bool:
    """Whether values survive src -> dst exactly (for the plain float dtypes, by width)."""
    if src.quant != "none" or dst.quant != "none":
        return (src.quant, src.dtype, src.scales) == (dst.quant, dst.dtype, dst.scales)
    rank = {"bf16": {"bf16", "f32"}, "f16": {"f16", "f32"}, "f32": {"f32"}}
    return dst.dtype in rank[src.dtype]


def decode(
    stored: torch.Tensor, layout: Layout, layer_id: int, planes: tuple[Plane, ...]
) -> torch.Tensor:
    """[..., stored width] in the layout's storage dtype -> float32 [..., sum of plane widths]."""
    q = layout.quant
    if q == "none":
        return stored.float()
    if q == "per_tensor":
        parts = [
            stored[..., a:b].float() * _scale(layout, layer_id, p)
            for p, (a, b) in zip(planes, _spans(planes), strict=True)
        ]
        return torch.cat(parts, dim=-1)
    if q == "per_token_head":
        width = stored.shape[-1] - SCALE_BYTES
        scale = stored[..., width:].contiguous().view(torch.uint8).view(torch.float32)
        return stored[..., :width].float() * scale
    if q == "fp8_ds_mla":
        return ds_mla_record.decode_records(stored)
    return _decode_ggml(stored, q)


def encode(
    values: torch.Tensor, layout: Layout, layer_id: int, planes: tuple[Plane, ...]
) -> torch.Tensor:
    """float32 [..., sum of plane widths] -> [..., stored width] in the storage dtype."""
    q, dtype = layout.quant, torch_dtype(layout.dtype)
    if q == "none":
        return values.to(dtype)
    if q == "per_tensor":
        parts = [
            _to_fp8(values[..., a:b] / _scale(layout, layer_id, p), dtype)
            for p, (a, b) in zip(planes, _spans(planes), strict=True)
        ]
        return torch.cat(parts, dim=-1)
    if q == "per_token_head":
        return _encode_per_token_head(values, layout.dtype)
    if q == "fp8_ds_mla":
        return ds_mla_record.encode_records(values)
    return _encode_ggml(values, q)


def _spans(planes: tuple[Plane, ...]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for p in planes:
        spans.append((start, start + p.width))
        start += p.width
    return spans


def _scale(layout: Layout, layer_id: int, plane: Plane) -> float:
    second = plane.name in ("v", "rope")  # scales are (k, v) per layer; MLA: (latent, rope)
    return layout.scales[2 * layer_id + second] if layout.scales else 1.0


def _to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max  # casting past the range gives NaN in e4m3fn: saturate
    return x.clamp(-limit, limit).to(dtype)


def _encode_per_token_head(values: torch.Tensor, dtype_name: str) -> torch.Tensor:
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[dtype_name], torch.ones_like(amax))
    scaled = values / scale
    if dtype_name == "int8":
        q = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        q = _to_fp8(scaled, torch_dtype(dtype_name))
    scale_bytes = scale.float().contiguous().view(torch.uint8).view(q.dtype)
    return torch.cat([q, scale_bytes], dim=-1)


def _ggml_type(name: str):  # noqa: ANN202 - gguf's enum
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


def _decode_ggml(stored: torch.Tensor, quant: str) -> torch.Tensor:
    from gguf import quants

    raw = stored.contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, _ggml_type(quant))))


def _encode_ggml(values: torch.Tensor, quant: str) -> torch.Tensor:
    from gguf import quants

    raw = values.float().contiguous().numpy()
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(raw, _ggml_type(quant))))
