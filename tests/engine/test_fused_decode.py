"""The fused decode step (all layers in one C++ call, kvabi/engine/fused_decode.py) against the
per-layer path it replaces: same ops, same kernels, so the same tokens and the same logprobs."""

import pytest
import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.fused_decode import FusedDecode
from kvabi.engine.sampling_params import SamplingParams
from kvabi.native.cpu_kernels import cpu_kernels
from tests.engine.tiny import run_all, tiny_loaded

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None or KERNELS.gemm is None,
    reason="the fused decode needs the packed GEMM (AMX or AVX512-BF16)",
)


def _pair(loaded, **config):
    fused = LLMEngine(loaded, EngineConfig(fused_decode=True, **config), "t")
    plain = LLMEngine(loaded, EngineConfig(fused_decode=False, **config), "t")
    assert fused.runner.fused is not None and plain.runner.fused is None
    return fused, plain


def _count_calls(engine: LLMEngine) -> list[int]:
    calls, inner = [0], engine.runner.fused.hidden_states

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    engine.runner.fused.hidden_states = counted
    return calls


def _same(fused_outs, plain_outs) -> None:
    for f, p in zip(fused_outs, plain_outs, strict=True):
        assert f.outputs[0].token_ids == p.outputs[0].token_ids
        assert f.outputs[0].logprobs == p.outputs[0].logprobs


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_fused_decode_equals_the_per_layer_path(layout):
    # block size 4: many block boundaries inside each table; mixed lengths in one step
    fused, plain = _pair(tiny_loaded(layers=3, dtype=torch.bfloat16), kv_layout=layout,
                         block_size=4)  # fmt: skip
    calls = _count_calls(fused)
    prompts = ["a", "the cat sat on", "x" * 37, "0123456789 " * 4]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    _same(run_all(fused, prompts, params), run_all(plain, prompts, params))
    assert calls[0] >= 11  # the decode steps went through it


def test_fused_decode_on_the_bundled_model():
    # The real shapes: head size 64 with 3 query heads per KV head (the AVX-512 attention),
    # 16 sequences of mixed lengths decoding together.
    from kvabi.models.registry import load_model

    loaded = load_model(None, "bf16", progress=False)
    fused, plain = _pair(loaded, max_num_batched_tokens=512, enable_prefix_caching=False)
    calls = _count_calls(fused)
    kernels, prefills = fused.runner.attention.kernels, [0]
    inner = kernels.prefill_attention

    def counted(*args):
        prefills[0] += 1
        return inner(*args)

    kernels.prefill_attention = counted  # the prompts' attention: the prefill kernel
    text = "the quick brown fox jumps over a lazy dog while seven ravens watch"
    words = text.split(" ")
    prompts = [" ".join(words[: 2 + i % 11]) * (1 + i // 5) for i in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    try:
        _same(run_all(fused, prompts, params), run_all(plain, prompts, params))
    finally:
        del kernels.prefill_attention
    assert calls[0] >= 15
    assert prefills[0] >= 16 * 30


def test_build_declines_what_it_cannot_run():
    loaded = tiny_loaded(dtype=torch.float32)  # float32 weights: no AMX GEMM
    engine = LLMEngine(loaded, EngineConfig(), "t")
    assert engine.runner.fused is None
    bf16 = LLMEngine(
        tiny_loaded(dtype=torch.bfloat16), EngineConfig(attention_backend="batched"), "t"
    )
    assert bf16.runner.fused is None  # no kernels with the torch attention backends
    assert FusedDecode.build(bf16.runner.model, bf16.cache.storage, None) is None
