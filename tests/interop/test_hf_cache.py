"""HF DynamicCache <-> kvabi: a real tiny Llama continues from an exported and re-imported cache."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvabi.abi.convert import convert  # noqa: E402
from kvabi.abi.descriptor import LayerSpec  # noqa: E402
from kvabi.abi.presets import preset_descriptor  # noqa: E402
from kvabi.interop.errors import (  # noqa: E402
    InteropError,
    ModelMismatchError,
    UnsupportedTypeError,
)
from kvabi.interop.hf_cache import (  # noqa: E402
    buffers_to_dynamic_cache,
    cache_kwarg,
    dynamic_cache_to_buffers,
    forward_with_cache,
    output_cache,
)
from kvabi.interop.model_spec import model_spec_from_hf_config, state_dict_fingerprint  # noqa: E402
from kvabi.wire import container_bytes, read_container  # noqa: E402

PROMPT = [3, 17, 99, 42, 5, 77, 8, 120, 64, 1, 33]  # 11 tokens: 2 full blocks of 4 and a partial
NEXT = 71


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def spec(model: LlamaForCausalLM):
    return model_spec_from_hf_config(model.config, state_dict_fingerprint(model.state_dict()))


@torch.no_grad()
def prefill(model: LlamaForCausalLM, tokens: list[int]) -> DynamicCache:
    return output_cache(forward_with_cache(model, torch.tensor([tokens]), None))


@torch.no_grad()
def continue_logits(model: LlamaForCausalLM, cache: DynamicCache, steps: int = 3) -> torch.Tensor:
    """Feed NEXT, then greedy tokens: logits of each step, stacked [steps, vocab]."""
    token, out = NEXT, []
    for _ in range(steps):
        outputs = forward_with_cache(model, torch.tensor([[token]]), cache)
        cache = output_cache(outputs)
        out.append(outputs.logits[0, -1])
        token = int(out[-1].argmax())
    return torch.stack(out)


def test_spec_from_config(model: LlamaForCausalLM, spec) -> None:
    assert spec.layers == (LayerSpec(num_kv_heads=2, k_dim=16, v_dim=16),) * 2
    assert (spec.rope_pairing, spec.rope_dim, spec.k_post_rope) == ("half", 0, True)
    assert spec.fingerprint.startswith("hf-sha256:") and len(spec.fingerprint) == 10 + 64


def test_export_is_the_cache(model: LlamaForCausalLM, spec) -> None:
    cache = prefill(model, PROMPT)
    buffers = dynamic_cache_to_buffers(cache, spec)
    assert buffers.desc.layout.name == "hf-dynamic" and buffers.desc.layout.dtype == "f32"
    assert buffers.extent == len(PROMPT)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(buffers.tensors[f"{i}.k"], layer.keys[0])  # [H, T, D]
        assert torch.equal(buffers.tensors[f"{i}.v"], layer.values[0])


def test_container_round_trip_continues_identically(model: LlamaForCausalLM, spec) -> None:
    reference = continue_logits(model, prefill(model, PROMPT))
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    read = read_container(container_bytes(buffers, PROMPT), expect=spec)
    assert read.token_ids == PROMPT
    cache = buffers_to_dynamic_cache(read.cache, model.config)
    # exact: the same forwards, of the same shapes, over K/V the round trip kept bit for bit
    assert torch.equal(continue_logits(model, cache), reference)


def test_through_paged_flashinfer_layout(model: LlamaForCausalLM, spec) -> None:
    reference = continue_logits(model, prefill(model, PROMPT))
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    paged_desc = preset_descriptor("vllm-flashinfer-hnd", spec, block_size=4, dtype="f32")
    paged = convert(buffers, paged_desc, num_tokens=len(PROMPT), dst_block_ids=[2, 0, 1])
    assert paged.extent == 3
    read = read_container(container_bytes(paged, PROMPT), expect=spec)
    with pytest.raises(InteropError, match="num_tokens"):
        buffers_to_dynamic_cache(read.cache, model.config)
    cache = buffers_to_dynamic_cache(
        read.cache, model.config, num_tokens=len(read.token_ids), block_ids=[2, 0, 1]
    )
    assert torch.equal(continue_logits(model, cache), reference)


def test_through_llamacpp_pairs_order(model: LlamaForCausalLM, spec) -> None:
    """To llama.cpp's K order (a permutation, exact in f32) and back: still identical."""
    reference = continue_logits(model, prefill(model, PROMPT))
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    pairs_desc = preset_descriptor("llamacpp-f32-vtrans", replace(spec, rope_pairing="pairs"))
    pairs = convert(buffers, pairs_desc, num_tokens=len(PROMPT))
    k_hf, k_pairs = buffers.tensors["1.k"], pairs.tensors["1.k"]  # [H, T, D], [T, H, D]
    assert torch.equal(k_pairs[:, :, 2 * 3 + 1], k_hf[:, :, 8 + 3].T)  # pairs 2i+a = half a*8+i
    assert torch.equal(pairs.tensors["1.v"], buffers.tensors["1.v"].transpose(1, 2))  # [H, D, T]
    assert torch.equal(continue_logits(model, buffers_to_dynamic_cache(pairs, model.config)),
                       reference)  # fmt: skip


def test_truncated_and_half_precision_import(model: LlamaForCausalLM, spec) -> None:
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    short = buffers_to_dynamic_cache(buffers, model.config, num_tokens=5)
    assert short.get_seq_length() == 5
    full = prefill(model, PROMPT).layers[0].keys  # [batch, heads, tokens, dim]
    assert torch.equal(short.layers[0].keys, full[:, :, :5])  # truncation is a slice: exact
    # A 5-token prefill computes the same keys with a GEMM of another row count, which blocks
    # (so rounds) differently by shape and CPU kind: equal to fp32 rounding of one projection.
    alone = prefill(model, PROMPT[:5]).layers[0].keys
    torch.testing.assert_close(short.layers[0].keys, alone, rtol=1e-5, atol=1e-6)
    half = buffers_to_dynamic_cache(buffers, model.config, dtype=torch.bfloat16)
    assert half.layers[1].values.dtype == torch.bfloat16


def test_batch_row(model: LlamaForCausalLM, spec) -> None:
    with torch.no_grad():
        cache = output_cache(forward_with_cache(model, torch.tensor([PROMPT, PROMPT[::-1]]), None))
    row = dynamic_cache_to_buffers(cache, spec, batch_index=1)
    assert torch.equal(row.tensors["0.k"], cache.layers[0].keys[1])


def test_refusals(model: LlamaForCausalLM, spec) -> None:
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    other = LlamaConfig(**{**model.config.to_dict(), "num_key_value_heads": 4})
    with pytest.raises(ModelMismatchError, match="geometry"):
        buffers_to_dynamic_cache(buffers, other)
    with pytest.raises(ModelMismatchError, match="layers"):
        dynamic_cache_to_buffers(prefill(model, PROMPT), replace(spec, layers=spec.layers * 2))
    ints = DynamicCache([(torch.zeros(1, 2, 3, 16, dtype=torch.int32),) * 2] * 2)
    with pytest.raises(UnsupportedTypeError, match="int32"):
        dynamic_cache_to_buffers(ints, spec)
    sliding = LlamaConfig(**{**model.config.to_dict(), "sliding_window": 8,
                             "layer_types": ["sliding_attention", "full_attention"]})  # fmt: skip
    with pytest.raises(InteropError, match="only filled"):
        dynamic_cache_to_buffers(DynamicCache(config=sliding), spec)
    assert [x.window for x in model_spec_from_hf_config(sliding).layers] == [8, 0]
    chunked = LlamaConfig(**{**model.config.to_dict(), "attention_chunk_size": 8,
                             "layer_types": ["chunked_attention", "full_attention"]})  # fmt: skip
    with pytest.raises(InteropError, match="chunked_attention"):
        model_spec_from_hf_config(chunked)


def test_cache_kwarg(model: LlamaForCausalLM) -> None:
    class OldModel:
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    assert cache_kwarg(model) == "cache"  # transformers 5.24
    assert cache_kwarg(OldModel()) == "past_key_values"


def test_state_dict_fingerprint_golden() -> None:
    tensors = {"b": torch.tensor([[1.0, -2.0]]), "a": torch.tensor([7], dtype=torch.int16)}
    digest = hashlib.sha256()
    digest.update(b"a\0int16\0" + struct.pack("<IQ", 1, 1) + b"\x07\x00")
    digest.update(b"b\0float32\0" + struct.pack("<IQQ", 2, 1, 2) + struct.pack("<ff", 1.0, -2.0))
    assert state_dict_fingerprint(tensors) == "hf-sha256:" + digest.hexdigest()
    tensors["b"][0, 1] = -2.0000002
    assert state_dict_fingerprint(tensors) != "hf-sha256:" + digest.hexdigest()
