"""LMCache 0.5.6's own code, run in .venv-lmcache by tests/interop/test_lmcache_blob*.py.

`encode SEED SCOPE DTYPE OUT`: random K/V [tokens, heads, dim] through LMCache's
AsymK16V8Codec; writes OUT.bin (the blob) and OUT.pt (K, V, LMCache's decode of the blob).
`decode IN OUT`: LMCache's codec decodes blob IN (V dequantised to K's dtype) into OUT.pt.
`detect IN OUT`: IN.json lists cases {name, engine, nest, shapes, kv_layout}; LMCache's
detect_format classifies zero tensors of those shapes; OUT.json maps each name to its
EngineKVFormat.
"""

import json
import sys
from pathlib import Path

import torch
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.kv_format import detect_format
from lmcache.v1.kv_codec import AsymK16V8Codec, CodecHashes, ScaleScope, dequantize_v_fp8

IDENTITY = CodecHashes(
    model_id="smollm2-135m", tokenizer_hash="tok0", attention_backend="FLASH_ATTN",
    kv_layout="NHD",
)  # fmt: skip


def encode(seed: int, scope: str, dtype: str, out: str) -> None:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(12, 2, 8, generator=g).to(getattr(torch, dtype))  # [tokens, heads, dim]
    v = torch.randn(12, 2, 8, generator=g).to(getattr(torch, dtype))
    codec = AsymK16V8Codec(scale_scope=ScaleScope[scope.upper()])
    enc = codec.encode(k, v, hashes=IDENTITY, layer_id=3, chunk_id=1, chunk_size=12,
                       page_size=4, kv_head_count=2, head_dim=8)  # fmt: skip
    blob = codec.to_bytes(enc)
    Path(out + ".bin").write_bytes(blob)
    # LMCache's decode dequantises the flat V, which fails for per-head scales; so V comes
    # back as fp8 and LMCache's dequantize_v_fp8 runs on it in K's shape (head axis -2).
    enc = codec.from_bytes(blob)
    dk, vq, scales = codec.decode(enc)
    dv = dequantize_v_fp8(vq.reshape(k.shape), scales, enc.scale_scope, out_dtype=k.dtype)
    torch.save({"k": k, "v": v, "dk": dk.reshape(k.shape), "dv": dv.reshape(v.shape)},
               out + ".pt")  # fmt: skip


def decode(src: str, out: str) -> None:
    codec = AsymK16V8Codec()
    enc = codec.from_bytes(Path(src).read_bytes())
    k, v, scales = codec.decode(enc, out_v_dtype=enc.k_dtype)
    hashes = {key: getattr(enc.hashes, key) for key in CodecHashes._CHECK_ORDER}
    torch.save({"k": k, "v": v, "scales": scales, "hashes": hashes,
                "kv_head_count": enc.kv_head_count, "layer_id": enc.layer_id}, out)  # fmt: skip


def detect(src: str, out: str) -> None:
    result = {}
    for case in json.loads(Path(src).read_text()):
        tensors = [torch.zeros(s, dtype=torch.bfloat16) for s in case["shapes"]]
        half = len(tensors) // 2
        nest = case["nest"]
        kv = {"tensor": tensors[0], "list": tensors, "kv_lists": [tensors[:half], tensors[half:]]}
        hints = {"kv_layout": case["kv_layout"]} if case["kv_layout"] else {}
        fmt, _ = detect_format(kv[nest], EngineType[case["engine"]], hints)
        result[case["name"]] = fmt.name
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "encode":
        encode(int(rest[0]), rest[1], rest[2], rest[3])
    elif cmd == "decode":
        decode(rest[0], rest[1])
    else:
        detect(rest[0], rest[1])
