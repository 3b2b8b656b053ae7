"""`kvabi bench convert`: GB/s per preset pair beside a plain memory copy of the same bytes."""

from __future__ import annotations

import torch

from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.catalog import catalog_model
from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.table import print_table
from kvabi.bench.report import best_seconds, write_json

# (source preset, destination preset, destination overrides); all share one block size
PAIRS = [
    ("vllm-flash-attn", "vllm-flash-attn-hnd", {}),
    ("vllm-flash-attn", "vllm-flashinfer", {}),
    ("vllm-flash-attn", "vllm-lbnhc", {}),
    ("vllm-flashinfer-hnd", "vllm-lbhnc", {}),
    ("vllm-flash-attn", "vllm-flash-attn-xl-hnd", {}),
    ("vllm-flash-attn", "trtllm", {"block_size": 16}),
    ("vllm-flash-attn", "vllm-flash-attn", {"dtype": "f32"}),
    ("vllm-flash-attn", "vllm-fp8", {"scales": ()}),
    ("vllm-flash-attn", "vllm-int8-per-token-head", {}),
]


def run(quick: bool, json_path: str | None, model_name: str = "smollm2-135m") -> dict:
    model = catalog_model(model_name)
    num_blocks = 64 if quick else 256  # x 16 tokens x 23 KB/token (bf16)
    repeats = 3 if quick else 7
    src_desc = preset_descriptor("vllm-flash-attn", model)
    src = CacheBuffers(
        src_desc,
        {k: torch.randn(v.shape).to(v.dtype) for k, v in allocate(src_desc, num_blocks).items()},
    )
    nbytes = src.num_bytes
    flat = [t.reshape(-1) for t in src.tensors.values()]
    copies = [torch.empty_like(t) for t in flat]
    memcpy_s = best_seconds(
        lambda: [c.copy_(t) for c, t in zip(copies, flat, strict=True)], repeats
    )
    rows, figures = (
        [],
        {
            "model": model_name,
            "num_blocks": num_blocks,
            "bytes": nbytes,
            "memcpy_gbps": nbytes / memcpy_s / 1e9,
            "pairs": {},
        },
    )
    for src_name, dst_name, overrides in PAIRS:
        dst_desc = preset_descriptor(dst_name, model, **overrides)
        out = CacheBuffers.empty(dst_desc, num_blocks)
        seconds = best_seconds(lambda d=dst_desc, o=out: convert(src, d, out=o), repeats)
        key = f"{src_name}->{dst_name}" + "".join(f",{k}={v}" for k, v in overrides.items())
        ratio = memcpy_s / seconds
        figures["pairs"][key] = {
            "gbps": nbytes / seconds / 1e9,
            "memcpy_ratio": ratio,
            "lossy": dst_desc.layout.quant != "none",
        }
        rows.append([key, nbytes / seconds / 1e9, ratio])
    print_table(
        f"kvabi bench convert: {model_name}, {num_blocks} blocks of 16 tokens, "
        f"{nbytes / 1e6:.1f} MB bf16; memcpy {figures['memcpy_gbps']:.2f} GB/s",
        ["pair", "GB/s", "vs memcpy"],
        rows,
    )
    permute = [v["memcpy_ratio"] for k, v in figures["pairs"].items() if not v["lossy"]]
    figures["min_permute_ratio"] = min(permute)
    write_json(json_path, figures)
    return figures
