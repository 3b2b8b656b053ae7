"""`kvabi bench convert`: GB/s per preset pair beside a plain memory copy of the same bytes
(the bf16 values' bytes, for the codecs both ways), the two interleaved (kvabi/bench/report.py:
a pair whose copy ran far below the machine's plain copy speed is flagged `disturbed` and given
no ratio)."""

from __future__ import annotations

import torch

from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.catalog import catalog_model
from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.table import print_table
from kvabi.bench.report import is_disturbed, machine, paired, plain_copy_gbps, write_json

# (source preset, destination preset, destination overrides); all share one block size. A
# source other than the bf16 one holds the same values, converted into it first; the
# quantised ones (fp8 with scale 1, int8 per token-head) are the codecs' way back to bf16.
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
    ("vllm-fp8", "vllm-flash-attn", {}),
    ("vllm-int8-per-token-head", "vllm-flash-attn", {}),
]
SOURCE_OVERRIDES = {"vllm-fp8": {"scales": ()}}


def run(quick: bool, json_path: str | None, model_name: str = "smollm2-135m") -> dict:
    model = catalog_model(model_name)
    num_blocks = 64 if quick else 256  # x 16 tokens x 23 KB/token (bf16)
    repeats = 5 if quick else 9
    reference = plain_copy_gbps()  # the machine's plain copy, before anything else runs
    src_desc = preset_descriptor("vllm-flash-attn", model)
    src = CacheBuffers(
        src_desc,
        {k: torch.randn(v.shape).to(v.dtype) for k, v in allocate(src_desc, num_blocks).items()},
    )
    nbytes = src.num_bytes
    flat = [t.reshape(-1) for t in src.tensors.values()]
    copies = [torch.empty_like(t) for t in flat]

    def memcpy() -> None:  # the same bytes, tensor by tensor, as a conversion moves them
        for c, t in zip(copies, flat, strict=True):
            c.copy_(t)

    figures: dict = {"model": model_name, "num_blocks": num_blocks, "bytes": nbytes,
                     "plain_copy_gbps": reference, "pairs": {}}  # fmt: skip
    rows = []
    sources = {"vllm-flash-attn": src}
    for src_name, dst_name, overrides in PAIRS:
        if src_name not in sources:
            desc = preset_descriptor(src_name, model, **SOURCE_OVERRIDES.get(src_name, {}))
            sources[src_name] = convert(src, desc)
        dst_desc = preset_descriptor(dst_name, model, **overrides)
        out = CacheBuffers.empty(dst_desc, num_blocks)
        timed = paired(
            memcpy, lambda s=sources[src_name], d=dst_desc, o=out: convert(s, d, out=o), repeats
        )
        key = f"{src_name}->{dst_name}" + "".join(f",{k}={v}" for k, v in overrides.items())
        baseline_gbps = nbytes / min(timed.baseline_s) / 1e9
        disturbed = is_disturbed(baseline_gbps, reference)
        ratio = None if disturbed else timed.ratio
        figures["pairs"][key] = {
            "gbps": nbytes / min(timed.measured_s) / 1e9,
            "memcpy_gbps": baseline_gbps,
            "memcpy_spread": timed.spread,
            "memcpy_ratio": ratio,
            "disturbed": disturbed,
            "lossy": {dst_desc.layout.quant, sources[src_name].desc.layout.quant} != {"none"},
        }
        shown = "disturbed" if ratio is None else f"{ratio:.3f}"
        rows.append([key, nbytes / min(timed.measured_s) / 1e9, baseline_gbps, timed.spread, shown])
    print_table(
        f"kvabi bench convert: {model_name}, {num_blocks} blocks of 16 tokens, "
        f"{nbytes / 1e6:.1f} MB bf16; the machine's plain copy {reference:.2f} GB/s",
        ["pair", "GB/s", "memcpy GB/s (interleaved)", "memcpy spread", "vs memcpy"],
        rows,
    )
    pairs = figures["pairs"].values()
    permute = [v["memcpy_ratio"] for v in pairs if not v["lossy"] and v["memcpy_ratio"]]
    lossy = [v["memcpy_ratio"] for v in pairs if v["lossy"] and v["memcpy_ratio"]]
    figures["min_permute_ratio"] = min(permute) if permute else None
    figures["min_codec_ratio"] = min(lossy) if lossy else None
    figures["num_disturbed"] = sum(v["disturbed"] for v in pairs)
    figures["ran_on"] = machine()
    print_table("ran on", ["what", "value"], list(figures["ran_on"].items()))
    write_json(json_path, figures)
    return figures
