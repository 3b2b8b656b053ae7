"""`kvabi bench mla`: what an MLA cache costs, what fp8 records lose, and how fast it decodes.

1. Bytes per token per layer of DeepSeek-V3's cache, from the ABI descriptors (`plan`): vLLM's
   bf16 latents (`vllm-mla`, 512 + 64 values), its fp8_ds_mla records (`vllm-fp8-ds-mla`) and
   the K/V that attention would cache without MLA (128 heads of K 192 + V 128, bf16); and what
   `kvabi plan --model deepseek-v3 --context 131072` gives for a whole request.
2. fp8_ds_mla against bf16 latents, teacher-forced through the engine (mla_accuracy.py) on a
   random DeepSeek-V3 with the real latent geometry.
3. Decode tokens/s of a mid-size random MLA model, engine (bf16 / fp8 cache) over HF
   `generate` (mla_decode.py), in bf16 where the CPU computes it natively, else fp32.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvabi.abi.catalog import catalog_model
from kvabi.abi.descriptor import ATTN, LayerSpec, ModelSpec
from kvabi.abi.plan import plan
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.table import print_table
from kvabi.bench.mla_accuracy import teacher_forced
from kvabi.bench.mla_decode import BATCHES, decode_rates
from kvabi.bench.mla_models import MLAShape, random_deepseek_v3, random_prompts
from kvabi.bench.report import write_json
from kvabi.models.registry import load_model
from kvabi.native.cpu_kernels import has_native_bf16, kernel_status

PLAN_CONTEXT = 131072
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# DeepSeek-V3's config.json: num_attention_heads 128, qk_nope_head_dim 128 + qk_rope_head_dim 64
# per K head, v_head_dim 128: the K/V an expanded (non-absorbed) cache holds per layer.
EXPANDED = LayerSpec(ATTN, num_kv_heads=128, k_dim=128 + 64, v_dim=128)
CACHES = {  # figure name -> preset
    "bf16": "vllm-mla",
    "fp8": "vllm-fp8-ds-mla",
    "expanded": "flashinfer-kv-tuple",  # any bf16 K/V preset with separate K and V planes
}


@dataclass(frozen=True)
class Sizes:
    accuracy: MLAShape
    num_prompts: int
    num_steps: int
    decode: MLAShape
    num_new: int
    repeats: int
    prompt_len: int = 16


FULL = Sizes(MLAShape(4, 256, 4, 512), 8, 32, MLAShape(8, 2048, 16, 5632), 32, 2)
QUICK = Sizes(MLAShape(4, 256, 4, 512), 4, 32, MLAShape(4, 1536, 12, 4096), 32, 2)
TINY = Sizes(MLAShape(2, 64, 2, 128, 16, 16), 4, 8, MLAShape(1, 64, 2, 128, 16, 16), 2, 1, 8)


def cache_bytes() -> dict[str, Any]:
    """DeepSeek-V3's KV bytes per token per layer, and per request at `PLAN_CONTEXT`."""
    mla = catalog_model("deepseek-v3")
    models = {
        "bf16": mla,
        "fp8": mla,
        "expanded": ModelSpec((EXPANDED,) * len(mla.layers), "deepseek-v3", rope_dim=64),
    }
    out: dict[str, Any] = {"num_layers": len(mla.layers), "plan_context": PLAN_CONTEXT}
    for name, preset in CACHES.items():
        kv = plan(preset_descriptor(preset, models[name]), PLAN_CONTEXT)
        out[f"{name}_bytes_per_token_layer"] = kv.bytes_per_token / len(mla.layers)
        out[f"{name}_request_bytes"] = kv.bytes_per_request
    per = {name: out[f"{name}_bytes_per_token_layer"] for name in CACHES}
    out["expanded_vs_bf16_ratio"] = per["expanded"] / per["bf16"]
    out["expanded_vs_fp8_ratio"] = per["expanded"] / per["fp8"]
    out["bf16_vs_fp8_ratio"] = per["bf16"] / per["fp8"]
    return out


def run(quick: bool, json_path: str | None, sizes: Sizes | None = None) -> dict:
    import transformers  # noqa: F401  (the bench needs the `hf` extra; fail before any work)

    sizes = sizes or (QUICK if quick else FULL)
    dtype = "bf16" if has_native_bf16() else "fp32"
    figures = cache_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        random_deepseek_v3(sizes.accuracy, Path(tmp))
        loaded = load_model(tmp, dtype="bf16", progress=False)
        prompts = random_prompts(sizes.num_prompts, sizes.prompt_len, seed=1)
        figures |= teacher_forced(loaded, prompts, sizes.num_steps)
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_deepseek_v3(sizes.decode, Path(tmp)).to(_TORCH_DTYPES[dtype])
        loaded = load_model(tmp, dtype=dtype, progress=False)
        prompts = random_prompts(max(BATCHES), sizes.prompt_len, seed=2)
        figures |= decode_rates(loaded, hf, prompts, sizes.num_new, sizes.repeats)
    figures |= {"decode_model": _describe(sizes.decode), "decode_dtype": dtype}
    figures |= {"num_new": sizes.num_new, "prompt_len": sizes.prompt_len, "ran_on": _ran_on()}
    _print(figures)
    write_json(json_path, figures)
    return figures


def _describe(s: MLAShape) -> str:
    return (f"{s.num_layers} layers, hidden {s.hidden}, {s.num_heads} heads, kv_lora 512 + "
            f"rope 64, nope {s.nope_dim} / v {s.v_dim}, dense MLP {s.intermediate}")  # fmt: skip


def _ran_on() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return {
        "cpu": next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?"),
        "torch_threads": torch.get_num_threads(),
        "native_bf16": has_native_bf16(),
        "kernels": kernel_status(),
        "mla_attention": "absorbed (paged_attention._attend_mla): torch SDPA over bf16 latents; "
        "over fp8_ds_mla records the C++ records kernel decodes (native backend)",
    }


def _print(f: dict[str, Any]) -> None:
    n, ctx = f["num_layers"], f["plan_context"]
    rows = [
        [name, preset, f[f"{name}_bytes_per_token_layer"], f[f"{name}_request_bytes"] / 1e9]
        for name, preset in CACHES.items()
    ]
    print_table(
        f"DeepSeek-V3 KV cache ({n} layers), from the descriptors; request = {ctx} tokens",
        ["cache", "preset", "B/token/layer", "GB/request"],
        rows,
    )
    print_table(
        "ratios",
        ["what", "ratio"],
        [
            [k, f[k]]
            for k in ("expanded_vs_bf16_ratio", "expanded_vs_fp8_ratio", "bf16_vs_fp8_ratio")
        ],
    )
    print_table(
        f"fp8_ds_mla vs bf16 latents, teacher-forced: {f['num_prompts']} prompts x "
        f"{f['num_steps']} steps, full-vocabulary logits",
        ["figure", "value"],
        [
            [k, f[k]]
            for k in (
                "fp8_top1_agreement_ratio",
                "max_abs_dlogit",
                "mean_abs_dlogit",
                "bf16_logit_std",
                "bf16_min_top2_margin",
            )
        ],
    )
    rows = []
    for batch in BATCHES:
        hf = f[f"batch{batch}_hf_tokens_per_s"]
        rows.append([batch, "HF generate", hf, 1.0])
        for name, label in (("bf16", "kvabi vllm-mla"), ("fp8", "kvabi fp8_ds_mla")):
            rows.append([batch, label, f[f"batch{batch}_{name}_tokens_per_s"],
                         f[f"batch{batch}_{name}_vs_hf_ratio"]])  # fmt: skip
    print_table(
        f"decode, {f['decode_dtype']} model ({f['decode_model']}); {f['prompt_len']}-token "
        f"prompts + {f['num_new']} tokens each",
        ["batch", "engine", "tokens/s", "vs HF"],
        rows,
    )
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()))
