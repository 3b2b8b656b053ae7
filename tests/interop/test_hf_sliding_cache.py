"""HF DynamicCache <-> kvabi for a sliding-window model: a tiny random Gemma 3 (window 4, layers
sliding, full, sliding) exports its hybrid cache as full-extent buffers whose sliding layers
hold only the window (zeros before), and continues identically from the re-imported cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from kvabi.abi.convert import convert  # noqa: E402
from kvabi.abi.descriptor import LayerSpec  # noqa: E402
from kvabi.abi.presets import preset_descriptor  # noqa: E402
from kvabi.interop.errors import InteropError, ModelMismatchError  # noqa: E402
from kvabi.interop.hf_cache import (  # noqa: E402
    buffers_to_dynamic_cache,
    dynamic_cache_to_buffers,
    forward_with_cache,
    output_cache,
)
from kvabi.interop.model_spec import model_spec_from_hf_config, state_dict_fingerprint  # noqa: E402
from kvabi.wire import container_bytes, read_container  # noqa: E402
from tests.models.hf_reference import randomize  # noqa: E402

WINDOW = 4
PROMPT = [3, 17, 90, 42, 5, 77, 8, 11, 64, 1, 33]  # 11 tokens: the window holds the last 3
NEXT = 71
S, F = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def model() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, layer_types=[S, F, S], query_pre_attn_scalar=16,
    )  # fmt: skip
    return randomize(Gemma3ForCausalLM(config))


@pytest.fixture(scope="module")
def spec(model: Gemma3ForCausalLM):
    return model_spec_from_hf_config(model.config, state_dict_fingerprint(model.state_dict()))


@torch.no_grad()
def prefill(model: Gemma3ForCausalLM, tokens: list[int]) -> DynamicCache:
    return output_cache(forward_with_cache(model, torch.tensor([tokens]), None))


@torch.no_grad()
def continue_logits(model: Gemma3ForCausalLM, cache: DynamicCache, steps: int = 6) -> torch.Tensor:
    """Feed NEXT, then greedy tokens: logits of each step [steps, vocab]. Six steps slide the
    window past every imported token."""
    token, out = NEXT, []
    for _ in range(steps):
        outputs = forward_with_cache(model, torch.tensor([[token]]), cache)
        cache = output_cache(outputs)
        out.append(outputs.logits[0, -1])
        token = int(out[-1].argmax())
    return torch.stack(out)


def test_spec_has_the_windows(spec) -> None:
    layer = LayerSpec(num_kv_heads=2, k_dim=16, v_dim=16)
    assert spec.layers == (replace(layer, window=WINDOW), layer, replace(layer, window=WINDOW))


def test_export_pads_sliding_layers_with_zeros(model: Gemma3ForCausalLM, spec) -> None:
    cache = prefill(model, PROMPT)
    assert [tuple(x.keys.shape[2:3]) for x in cache.layers] == [(3,), (11,), (3,)]
    buffers = dynamic_cache_to_buffers(cache, spec)
    assert buffers.extent == len(PROMPT) and buffers.desc.model.layers == spec.layers
    assert torch.equal(buffers.tensors["1.k"], cache.layers[1].keys[0])  # full: the cache
    for i in (0, 2):
        for plane, held in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):
            got = buffers.tensors[f"{i}.{plane}"]  # [H, T, D]
            assert got.shape == (2, 11, 16)
            assert not got[:, :8].any()  # positions 0..7: before the window of position 11
            assert torch.equal(got[:, 8:], held[0])


def test_import_keeps_what_hf_keeps(model: Gemma3ForCausalLM, spec) -> None:
    original = prefill(model, PROMPT)
    cache = buffers_to_dynamic_cache(dynamic_cache_to_buffers(original, spec), model.config)
    for got, want in zip(cache.layers, original.layers, strict=True):
        assert type(got) is type(want) and got.get_seq_length() == want.get_seq_length() == 11
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


@pytest.mark.parametrize("num_tokens", [2, 3, 4, 11])  # shorter than, at, past the window
def test_round_trip_continues_identically(model: Gemma3ForCausalLM, spec, num_tokens: int) -> None:
    prompt = PROMPT[:num_tokens]
    reference = continue_logits(model, prefill(model, prompt))
    buffers = dynamic_cache_to_buffers(prefill(model, prompt), spec)
    read = read_container(container_bytes(buffers, prompt), expect=spec)
    cache = buffers_to_dynamic_cache(read.cache, model.config)
    # exact: the same forwards over K/V the round trip kept bit for bit
    assert torch.equal(continue_logits(model, cache), reference)


def test_through_paged_layout_and_llamacpp_order(model: Gemma3ForCausalLM, spec) -> None:
    reference = continue_logits(model, prefill(model, PROMPT))
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    paged_desc = preset_descriptor("vllm-flashinfer-hnd", spec, block_size=4, dtype="f32")
    paged = convert(buffers, paged_desc, num_tokens=len(PROMPT), dst_block_ids=[2, 0, 1])
    cache = buffers_to_dynamic_cache(
        paged, model.config, num_tokens=len(PROMPT), block_ids=[2, 0, 1]
    )
    assert torch.equal(continue_logits(model, cache), reference)
    pairs_desc = preset_descriptor("llamacpp-f32-vtrans", replace(spec, rope_pairing="pairs"))
    pairs = convert(buffers, pairs_desc, num_tokens=len(PROMPT))
    assert torch.equal(continue_logits(model, buffers_to_dynamic_cache(pairs, model.config)),
                       reference)  # fmt: skip


def test_a_layer_that_kept_more_keeps_only_the_window(model: Gemma3ForCausalLM, spec) -> None:
    cache = prefill(model, PROMPT)
    window_k = cache.layers[0].keys
    # as if it had recorded the past (`activate_past_recording`): 8 more tokens in front
    for name in ("keys", "values"):
        held = getattr(cache.layers[0], name)
        setattr(cache.layers[0], name, torch.cat([torch.ones(1, 2, 8, 16), held], dim=2))
    buffers = dynamic_cache_to_buffers(cache, spec)
    assert not buffers.tensors["0.k"][:, :8].any() and not buffers.tensors["0.v"][:, :8].any()
    assert torch.equal(buffers.tensors["0.k"][:, 8:], window_k[0])


def test_refusals(model: Gemma3ForCausalLM, spec) -> None:
    cache = prefill(model, PROMPT)
    cache.layers[2].keys = cache.layers[2].keys[:, :, 1:]  # 2 of the 3 tokens the window needs
    with pytest.raises(InteropError, match="holds 2 tokens.*needs the last 3"):
        dynamic_cache_to_buffers(cache, spec)
    no_window = replace(spec, layers=tuple(replace(x, window=0) for x in spec.layers))
    with pytest.raises(ModelMismatchError, match="layer 0: the cache's window is 4, the model's 0"):
        dynamic_cache_to_buffers(prefill(model, PROMPT), no_window)
    with pytest.raises(InteropError, match="only filled"):
        dynamic_cache_to_buffers(DynamicCache(config=model.config), spec)
    buffers = dynamic_cache_to_buffers(prefill(model, PROMPT), spec)
    # the window of position 10 starts at 7, which the buffers of 11 tokens hold as zeros
    with pytest.raises(InteropError, match="sliding layer 0 .* no KV at position 7"):
        buffers_to_dynamic_cache(buffers, model.config, num_tokens=10)
    bare = replace(buffers, desc=replace(buffers.desc, model=no_window))
    with pytest.raises(ModelMismatchError, match="windows"):
        buffers_to_dynamic_cache(bare, model.config)
