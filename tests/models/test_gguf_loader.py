"""GGUF -> our weights: a GGUF written here from a random HF model loads back to HF's weights."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvabi.models import RopeScaling, gguf_loader, load_gguf
from kvabi.models.errors import CheckpointError, MissingFieldError, UnknownArchitectureError
from kvabi.models.gguf_loader import unpermute_qk
from tests.models.tiny import LLAMA3_ROPE, TINY, hf_logits, make_hf, our_logits, random_ids

pytest.importorskip("transformers")

_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converter_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute, per head of size d: (2, d/2) -> (d/2, 2)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def converter_rope_freqs(rope: dict[str, float], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's Llama-3 `rope_freqs` loop, transcribed."""
    freqs = 1.0 / (
        rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    )
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{suffix}"


def write_gguf(
    path: Path,
    hf: torch.nn.Module,
    arch: str,
    qtype: Q,
    rope_freqs: np.ndarray | None = None,
    eot_token_id: int | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """Write like llama.cpp: llama permutes Q/K rows, qwen2 does not; 1-D tensors stay F32."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    if rope_freqs is not None:
        writer.add_rope_scaling_orig_ctx_len(
            cfg.rope_parameters["original_max_position_embeddings"]
        )
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array, target = tensor.numpy(), gguf_name(name)
        if arch == "llama" and target.split(".")[-2] in heads:
            array = converter_permute(array, heads[target.split(".")[-2]])
        if array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, array)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def expected_weight(tensor: torch.Tensor, qtype: Q) -> torch.Tensor:
    """HF's weight after the same rounding: quantisation blocks run along rows, so the row
    permutation commutes with it and the un-permuted result is exactly this."""
    if tensor.ndim != 2 or qtype == Q.F32:
        return tensor
    array = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), qtype), qtype)
    return torch.from_numpy(array)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_equal_hf(tmp_path: Path, arch: str, qtype: Q) -> None:
    hf = make_hf(arch)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, arch, qtype)
    checkpoint = load_gguf(path, progress=False)
    hf_weights = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    assert checkpoint.state_dict.keys() == hf_weights.keys()
    for name, weight in hf_weights.items():
        assert torch.equal(checkpoint.state_dict[name], expected_weight(weight, qtype)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_hf(tmp_path: Path, arch: str) -> None:
    hf = make_hf(arch, tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, arch, Q.F32)
    checkpoint = load_gguf(path, progress=False)
    assert checkpoint.config.tie_word_embeddings
    assert checkpoint.config.attention_bias == (arch == "qwen2")
    ids = random_ids(20)
    torch.testing.assert_close(
        our_logits(checkpoint.build(), ids), hf_logits(hf, ids), atol=1e-5, rtol=0
    )


def test_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    hf = make_hf("llama", rope_parameters=LLAMA3_ROPE)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "llama", Q.F32, converter_rope_freqs(LLAMA3_ROPE, TINY["head_dim"]))
    checkpoint = load_gguf(path, progress=False)
    scaling = checkpoint.config.rope_scaling
    assert isinstance(scaling, RopeScaling) and scaling.rope_type == "llama3"
    fitted = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor)
    np.testing.assert_allclose(fitted, (8.0, 1.0, 4.0), rtol=1e-5)
    assert scaling.original_max_position_embeddings == 64
    model = checkpoint.build()
    torch.testing.assert_close(
        model.rotary.inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0
    )
    ids = random_ids(20)
    torch.testing.assert_close(our_logits(model, ids), hf_logits(hf, ids), atol=1e-5, rtol=0)


def test_config_matches_metadata(tmp_path: Path) -> None:
    hf = make_hf("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "llama", Q.F32, eot_token_id=7)
    config = load_gguf(path, progress=False).config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (96, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert (config.bos_token_id, config.eos_token_ids, config.architecture) == (1, (2, 7), "llama")
    assert config.rms_norm_eps == pytest.approx(1e-6) and config.rope_scaling is None


def test_unpermute_inverts_the_converter() -> None:
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    back = unpermute_qk(torch.from_numpy(converter_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))
    assert torch.equal(
        unpermute_qk(torch.from_numpy(converter_permute(w[:, 0], 4)), 4), torch.from_numpy(w[:, 0])
    )


def test_bf16_weights(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, make_hf("llama"), "llama", Q.Q8_0)
    checkpoint = load_gguf(path, dtype=torch.bfloat16, progress=False)
    assert {t.dtype for t in checkpoint.state_dict.values()} == {torch.bfloat16}


def test_unknown_architecture_names_it_and_the_supported(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    write_gguf(path, make_hf("llama"), "gemma", Q.F32)
    with pytest.raises(
        UnknownArchitectureError, match=r"'gemma'.*supported: \['gemma3', 'llama', 'qwen2'\]"
    ):
        load_gguf(path, progress=False)


def metadata_only_gguf(path: Path, arch: str, block_count: int = 2) -> Path:
    """A GGUF of `arch` holding only its block count: every other field is missing."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(block_count)
    writer.add_key_length(16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "missing"),
    [
        ("llama", "'llama.attention.head_count' is missing"),
        ("gemma3", "tensor 'token_embd.weight' is missing"),  # the vocab size is read from it
    ],
)
def test_missing_field_is_named(tmp_path: Path, arch: str, missing: str) -> None:
    path = metadata_only_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(MissingFieldError, match=missing):
        load_gguf(path, progress=False)


def test_unknown_tensor_is_named_before_any_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    sinks = {"blk.1.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    write_gguf(path, make_hf("llama"), "llama", Q.F32, extra_tensors=sinks)
    dequantised: list[str] = []
    real = gguf_loader._dequantize
    monkeypatch.setattr(gguf_loader, "_dequantize", lambda t: dequantised.append(t.name) or real(t))
    with pytest.raises(CheckpointError, match="'blk.1.attn_sinks.weight' has no llama counterpart"):
        load_gguf(path, progress=False)
    assert dequantised == []


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_gguf(missing)


def test_not_a_gguf_names_the_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=str(junk)):
        load_gguf(junk)
