"""Which LMCache 0.5.6 `EngineKVFormat` each kvabi preset is, as data (docs/PEERS.md).

LMCache's `detect_format` (lmcache/v1/gpu_connector/kv_format/detection.py) classifies the
tensors an engine registers; `engine_tensor_shapes` gives the shapes the engine hands it for
a kvabi preset (vLLM: one tensor per layer, or one cross-layer pool; SGLang: K and V lists
of `[slots, H, D]`), and the table names the member LMCache must answer.
`tests/interop/test_lmcache_formats.py` runs LMCache's detector on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.descriptor import Descriptor

# How the engine hands its KV to LMCache, from kvabi's buffers of that preset:
#   layer: one buffer per layer, as is;  layer_kc: ... with K and C merged (vLLM's 2*D);
#   layer_mla: ... with the 1-head axis dropped ([B, N, C]);  pool: the one cross-layer tensor;
#   kv_slots: SGLang's k_buffer, v_buffer lists of [B*N, H, D];  slots: one list of [B*N, 1, C].
FORMS = ("layer", "layer_kc", "layer_mla", "pool", "kv_slots", "slots")


@dataclass(frozen=True)
class LMCacheFormat:
    """One row: a kvabi preset, how its engine registers it, and LMCache's name for it."""

    preset: str
    engine: str  # LMCache's EngineType member
    form: str  # one of FORMS
    kv_layout: str  # the layout hint the engine passes ("" for none)
    engine_kv_format: str  # lmcache_native.EngineKVFormat member


LMCACHE_FORMATS = (
    LMCacheFormat("vllm-flash-attn", "VLLM", "layer", "NHD", "NL_X_TWO_NB_BS_NH_HS"),
    LMCacheFormat("vllm-flash-attn-hnd", "VLLM", "layer", "HND", "NL_X_TWO_NB_NH_BS_HS"),
    LMCacheFormat("vllm-fp8", "VLLM", "layer", "NHD", "NL_X_TWO_NB_BS_NH_HS"),
    LMCacheFormat("vllm-flashinfer", "VLLM", "layer", "NHD", "NL_X_NB_TWO_BS_NH_HS"),
    LMCacheFormat("vllm-flashinfer-hnd", "VLLM", "layer", "HND", "NL_X_NB_TWO_NH_BS_HS"),
    LMCacheFormat("vllm-triton", "VLLM", "layer", "NHD", "NL_X_NB_TWO_BS_NH_HS"),
    LMCacheFormat("vllm-lbnhc", "VLLM", "layer_kc", "NHD", "NL_X_NB_BS_NH_CS"),
    LMCacheFormat("vllm-lbhnc", "VLLM", "layer_kc", "HND", "NL_X_NB_NH_BS_CS"),
    LMCacheFormat("vllm-flash-attn-xl", "VLLM", "pool", "NHD", "NB_NL_TWO_BS_NH_HS"),
    LMCacheFormat("vllm-mla", "VLLM", "layer_mla", "NHD", "NL_X_NB_BS_HS"),
    LMCacheFormat("vllm-fp8-ds-mla", "VLLM", "layer_mla", "NHD", "NL_X_NB_BS_HS"),
    LMCacheFormat("sglang-mha", "SGLANG", "kv_slots", "", "TWO_X_NL_X_NBBS_NH_HS"),
    LMCacheFormat("sglang-mla", "SGLANG", "slots", "", "NL_X_NBBS_ONE_HS"),
)


def engine_tensor_shapes(row: LMCacheFormat, desc: Descriptor, num_blocks: int) -> list[list]:
    """The shapes of the tensors `row`'s engine registers for `desc` (K layers then V layers
    for `kv_slots`; one shape for `pool`)."""
    if row.form not in FORMS:
        raise ValueError(f"form {row.form!r}; expected one of {FORMS}")
    specs = {s.key: list(s.shape) for s in buffer_specs(desc, num_blocks)}
    if row.form == "pool":
        return [specs["all"]]
    layers = range(desc.model.num_layers)
    if row.form == "kv_slots":
        return [_slots(specs[f"{i}.{p}"]) for p in ("k", "v") for i in layers]
    shapes = [specs[str(i)] for i in layers]
    if row.form == "layer_kc":
        return [s[:-2] + [s[-2] * s[-1]] for s in shapes]
    if row.form == "layer_mla":
        return [s[:2] + s[3:] for s in shapes]
    if row.form == "slots":
        return [_slots(s) for s in shapes]
    return shapes


def _slots(shape: list) -> list:
    return [shape[0] * shape[1], *shape[2:]]  # [B, N, H, C] -> [B*N, H, C]
