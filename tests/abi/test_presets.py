"""Each preset's encoding against an independent construction: the engine's tensor shape as the
engine documents it, filled token by token with explicit indexing (no kvabi view code)."""

import struct

import numpy as np
import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import ATTN, MLA, LayerSpec, Layout, ModelSpec
from kvabi.abi.presets import PRESETS, preset_descriptor
from tests.abi.test_vllm_cpu_presets import COVERED as VLLM_CPU_COVERED

L, H, D, T, BS = 2, 2, 32, 11, 4
NB = -(-T // BS)
ATTN_MODEL = ModelSpec((LayerSpec(ATTN, H, D, D),) * L, "m")
MLA_MODEL = ModelSpec((LayerSpec(MLA, latent_dim=512, rope_dim=64),) * L, "m")


def _source(model, planes, seed=0):
    """Canonical f32 cache (unpaged, separate planes) and its values per layer and plane."""
    g = torch.Generator().manual_seed(seed)
    lay = Layout("THC", 0, "f32", planes="separate")
    from kvabi.abi.descriptor import Descriptor

    desc = Descriptor(model, lay)
    vals = {
        f"{l}.{p}": torch.randn(T, h, w, generator=g).bfloat16().float()
        for l in range(L)
        for p, h, w in planes
    }
    return CacheBuffers(desc, vals), vals


def _tokens():
    return [(t, t // BS, t % BS) for t in range(T)]


def _per_layer(shape, fill):
    def build(vals):
        out = {}
        for l in range(L):
            buf = torch.zeros(shape)
            for t, b, n in _tokens():
                fill(buf, b, n, vals[f"{l}.k"][t], vals[f"{l}.v"][t])
            out[str(l)] = buf
        return out

    return build


def _cross(shape, fill):
    def build(vals):
        buf = torch.zeros(shape)
        for l in range(L):
            for t, b, n in _tokens():
                fill(buf, l, b, n, vals[f"{l}.k"][t], vals[f"{l}.v"][t])
        return {"all": buf}

    return build


def _split(shape, put):
    def build(vals):
        out = {}
        for l in range(L):
            for p in "kv":
                buf = torch.zeros(shape(p))
                for t, b, n in _tokens():
                    put(buf, p, t, b, n, vals[f"{l}.{p}"][t])
                out[f"{l}.{p}"] = buf
        return out

    return build


def _set(buf, idx, value):
    buf[idx] = value


ATTN_EXPECTED = {
    "vllm-flash-attn": _per_layer(
        (2, NB, BS, H, D), lambda x, b, n, k, v: (_set(x, (0, b, n), k), _set(x, (1, b, n), v))
    ),
    "vllm-flash-attn-hnd": _per_layer(
        (2, NB, H, BS, D),
        lambda x, b, n, k, v: (
            _set(x, (0, b, slice(None), n), k),
            _set(x, (1, b, slice(None), n), v),
        ),
    ),
    "vllm-flashinfer": _per_layer(
        (NB, 2, BS, H, D), lambda x, b, n, k, v: (_set(x, (b, 0, n), k), _set(x, (b, 1, n), v))
    ),
    "vllm-triton": _per_layer(
        (NB, 2, BS, H, D), lambda x, b, n, k, v: (_set(x, (b, 0, n), k), _set(x, (b, 1, n), v))
    ),
    "vllm-flashinfer-hnd": _per_layer(
        (NB, 2, H, BS, D),
        lambda x, b, n, k, v: (
            _set(x, (b, 0, slice(None), n), k),
            _set(x, (b, 1, slice(None), n), v),
        ),
    ),
    "flashinfer-nhd": _per_layer(
        (NB, 2, BS, H, D), lambda x, b, n, k, v: (_set(x, (b, 0, n), k), _set(x, (b, 1, n), v))
    ),
    "flashinfer-hnd": _per_layer(
        (NB, 2, H, BS, D),
        lambda x, b, n, k, v: (
            _set(x, (b, 0, slice(None), n), k),
            _set(x, (b, 1, slice(None), n), v),
        ),
    ),
    # vLLM standardized (B,H,N,2D): per (token, head) D of K then D of V
    "vllm-lbhnc": _per_layer(
        (NB, H, BS, 2 * D),
        lambda x, b, n, k, v: (
            _set(x, (b, slice(None), n, slice(0, D)), k),
            _set(x, (b, slice(None), n, slice(D, None)), v),
        ),
    ),
    "vllm-lbnhc": _per_layer(
        (NB, BS, H, 2 * D),
        lambda x, b, n, k, v: (
            _set(x, (b, n, slice(None), slice(0, D)), k),
            _set(x, (b, n, slice(None), slice(D, None)), v),
        ),
    ),
    "vllm-flash-attn-xl": _cross(
        (NB, L, 2, BS, H, D),
        lambda x, l, b, n, k, v: (_set(x, (b, l, 0, n), k), _set(x, (b, l, 1, n), v)),
    ),
    "vllm-flash-attn-xl-hnd": _cross(
        (NB, H, L, 2, BS, D),
        lambda x, l, b, n, k, v: (
            _set(x, (b, slice(None), l, 0, n), k),
            _set(x, (b, slice(None), l, 1, n), v),
        ),
    ),
    "vllm-flashinfer-xl-hnd": _cross(
        (NB, 2, H, L, BS, D),
        lambda x, l, b, n, k, v: (
            _set(x, (b, 0, slice(None), l, n), k),
            _set(x, (b, 1, slice(None), l, n), v),
        ),
    ),
    "vllm-blhnc": _cross(
        (NB, L, H, BS, 2 * D),
        lambda x, l, b, n, k, v: (
            _set(x, (b, l, slice(None), n, slice(0, D)), k),
            _set(x, (b, l, slice(None), n, slice(D, None)), v),
        ),
    ),
    "vllm-blnhc": _cross(
        (NB, L, BS, H, 2 * D),
        lambda x, l, b, n, k, v: (
            _set(x, (b, l, n, slice(None), slice(0, D)), k),
            _set(x, (b, l, n, slice(None), slice(D, None)), v),
        ),
    ),
    # TensorRT-LLM pool {blocks, layers, kvFactor, H*tokens*D}, HND inside the block
    "trtllm": _cross(
        (NB, L, 2, H, BS, D),
        lambda x, l, b, n, k, v: (
            _set(x, (b, l, 0, slice(None), n), k),
            _set(x, (b, l, 1, slice(None), n), v),
        ),
    ),
    # SGLang [slots, H, D] with slot = page * page_size + offset
    "sglang-mha": _split(
        lambda p: (NB * BS, H, D), lambda x, p, t, b, n, val: _set(x, b * BS + n, val)
    ),
    "sglang-mha-hnd": _split(
        lambda p: (NB, H, BS, D), lambda x, p, t, b, n, val: _set(x, (b, slice(None), n), val)
    ),
    "flashinfer-kv-tuple": _split(
        lambda p: (NB, BS, H, D), lambda x, p, t, b, n, val: _set(x, (b, n), val)
    ),
    # HF DynamicLayer keys/values [batch=1 row] -> [H, S, D]
    "hf-dynamic": _split(
        lambda p: (H, T, D), lambda x, p, t, b, n, val: _set(x, (slice(None), t), val)
    ),
    # llama.cpp rows [cell][H*D]; V^T [H*D][cell]
    "llamacpp-f16": _split(
        lambda p: (T, H * D), lambda x, p, t, b, n, val: _set(x, t, val.reshape(-1))
    ),
    "llamacpp-f32": _split(
        lambda p: (T, H * D), lambda x, p, t, b, n, val: _set(x, t, val.reshape(-1))
    ),
    "llamacpp-bf16": _split(
        lambda p: (T, H * D), lambda x, p, t, b, n, val: _set(x, t, val.reshape(-1))
    ),
    "llamacpp-f16-vtrans": _split(
        lambda p: (T, H * D) if p == "k" else (H * D, T),
        lambda x, p, t, b, n, val: _set(x, t if p == "k" else (slice(None), t), val.reshape(-1)),
    ),
    "llamacpp-bf16-vtrans": _split(
        lambda p: (T, H * D) if p == "k" else (H * D, T),
        lambda x, p, t, b, n, val: _set(x, t if p == "k" else (slice(None), t), val.reshape(-1)),
    ),
    "llamacpp-f32-vtrans": _split(
        lambda p: (T, H * D) if p == "k" else (H * D, T),
        lambda x, p, t, b, n, val: _set(x, t if p == "k" else (slice(None), t), val.reshape(-1)),
    ),
}


def _flat_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", sorted(ATTN_EXPECTED))
def test_plain_preset_matches_engine_construction(name):
    src, vals = _source(ATTN_MODEL, [("k", H, D), ("v", H, D)])
    desc = preset_descriptor(
        name, ATTN_MODEL, **({"block_size": BS} if PRESETS[name].layout.is_paged else {})
    )
    got = convert(src, desc, num_tokens=T, out=CacheBuffers.empty(desc, _extent(desc), "zeros"))
    want = ATTN_EXPECTED[name](vals)
    assert sorted(got.tensors) == sorted(want)
    for key, tensor in want.items():
        assert _flat_bytes(got.tensors[key]) == _flat_bytes(tensor.to(got.tensors[key].dtype)), key


def _extent(desc):
    return NB if desc.layout.is_paged else T


def test_every_attention_preset_is_covered_by_a_construction():
    quantised = {"vllm-fp8", "vllm-int8-per-token-head", "vllm-fp8-per-token-head"}
    quantised |= {f"llamacpp-{q}" for q in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}
    attn = {n for n, p in PRESETS.items() if p.kind == ATTN}
    assert attn - quantised - set(VLLM_CPU_COVERED) == set(ATTN_EXPECTED)


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_ggml_rows_match_ggml_row_quantisation(quant):
    from gguf import GGMLQuantizationType, quants

    src, vals = _source(ATTN_MODEL, [("k", H, D), ("v", H, D)])
    got = convert(src, preset_descriptor(f"llamacpp-{quant}", ATTN_MODEL), num_tokens=T)
    for key, tensor in vals.items():
        rows = quants.quantize(
            tensor.reshape(T, H * D).numpy(), GGMLQuantizationType[quant.upper()]
        )
        assert got.tensors[key].reshape(T, -1).numpy().tobytes() == rows.tobytes(), key


def test_per_token_head_int8_record():
    src, vals = _source(ATTN_MODEL, [("k", H, D), ("v", H, D)])
    desc = preset_descriptor("vllm-int8-per-token-head", ATTN_MODEL, block_size=BS)
    got = convert(src, desc, num_tokens=T)
    buf = got.tensors["1"].numpy().view(np.uint8)  # (B, 2, N, H, D + 4)
    for t, b, n in _tokens():
        for plane, p in (("k", 0), ("v", 1)):
            for h in range(H):
                x = vals[f"1.{plane}"][t, h].numpy().astype(np.float32)
                scale = np.float32(np.abs(x).max()) / np.float32(127.0)
                q = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
                record = q.tobytes() + struct.pack("<f", scale)
                assert buf[b, p, n, h].tobytes() == record


def test_per_tensor_fp8_uses_the_layer_scales():
    src, vals = _source(ATTN_MODEL, [("k", H, D), ("v", H, D)])
    scales = (0.5, 2.0, 0.25, 4.0)
    desc = preset_descriptor("vllm-fp8", ATTN_MODEL, block_size=BS, scales=scales)
    got = convert(src, desc, num_tokens=T)
    for t, b, n in _tokens():
        want = (vals["1.v"][t] / 4.0).to(torch.float8_e4m3fn)
        assert torch.equal(got.tensors["1"][1, b, n].view(torch.uint8), want.view(torch.uint8))


MLA_PLANES = [("latent", 1, 512), ("rope", 1, 64)]


def _ds_mla_record(latent: np.ndarray, rope: np.ndarray) -> bytes:
    out = b""
    scales = []
    for i in range(4):
        tile = latent[128 * i : 128 * (i + 1)]
        scale = max(np.float32(np.abs(tile).max()) / np.float32(448.0), np.float32(2.0**-126))
        scales.append(scale)
        out += (
            torch.from_numpy(tile / scale)
            .to(torch.float8_e4m3fn)
            .view(torch.uint8)
            .numpy()
            .tobytes()
        )
    out += struct.pack("<4f", *scales)
    out += torch.from_numpy(rope).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert len(out) == 656
    return out


@pytest.mark.parametrize(
    "name", ["vllm-mla", "sglang-mla", "flashinfer-mla", "trtllm-mla", "vllm-fp8-ds-mla"]
)
def test_mla_presets(name):
    src, vals = _source(MLA_MODEL, MLA_PLANES)
    desc = preset_descriptor(name, MLA_MODEL, block_size=BS)
    got = convert(src, desc, num_tokens=T, out=CacheBuffers.empty(desc, NB, "zeros"))
    for t, b, n in _tokens():
        for l in range(L):
            lat, rope = vals[f"{l}.latent"][t, 0], vals[f"{l}.rope"][t, 0]
            if name == "flashinfer-mla":  # ckv [P, page, 512] and kpe [P, page, 64]
                assert torch.equal(
                    got.tensors[f"{l}.latent"].reshape(NB, BS, 512)[b, n], lat.bfloat16()
                )
                assert torch.equal(
                    got.tensors[f"{l}.rope"].reshape(NB, BS, 64)[b, n], rope.bfloat16()
                )
                continue
            if name == "trtllm-mla":  # {blocks, layers, 1, [1, tokens, 576]}
                row = got.tensors["all"].reshape(NB, L, BS, 576)[b, l, n]
            else:  # [slots or (B, N), 576]
                row = got.tensors[str(l)].reshape(NB * BS, -1)[b * BS + n]
            if name == "vllm-fp8-ds-mla":
                assert row.numpy().tobytes() == _ds_mla_record(lat.numpy(), rope.numpy())
            else:
                assert torch.equal(row, torch.cat([lat, rope]).bfloat16())


def test_hf_dynamic_mla_is_hfs_keys_and_values():
    """HF DeepseekV3's DynamicLayer: keys c_kv [batch, 1, S, 512], values k_pe [batch, 1, S, 64];
    one batch row is `{layer}.latent` [1, T, 512] and `{layer}.rope` [1, T, 64], token t at t."""
    src, vals = _source(MLA_MODEL, MLA_PLANES)
    desc = preset_descriptor("hf-dynamic-mla", MLA_MODEL, dtype="f32")
    got = convert(src, desc, num_tokens=T)
    assert sorted(got.tensors) == sorted(f"{l}.{p}" for l in range(L) for p in ("latent", "rope"))
    for key, tensor in vals.items():  # [T, 1, width]
        assert torch.equal(got.tensors[key], tensor.transpose(0, 1)), key
