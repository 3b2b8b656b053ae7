"""`attention_paths` (what `kvabi plan` reports) against what the engine really runs: for each
model and layout, a real engine serves a prompt while its C++ attention kernels are counted;
each kernel must run exactly once per step for each layer the plan sends to it (per prefill
sequence, per decode step), and never for a layer the plan sends to the general path. On a CPU
without AMX the prefill kernel is expected nowhere, on one with AMX where the plan says; both
directions are the same assertion. Plus the reasons the plan gives where the engine has no
kernels at all, and the fused decode's presence.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from kvabi.engine.attention_plan import attention_paths, fused_decode_gap
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models import load_model
from kvabi.models.config import ModelConfig
from kvabi.models.llama import LlamaModel
from kvabi.models.registry import LoadedModel, query_heads
from kvabi.native.cpu_kernels import CpuKernels, cpu_kernels
from tests.engine.tiny import EOS, tiny_tokenizer
from tests.models import test_deepseek_v3, test_gemma4, test_laguna
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")
KERNELS = ("prefill_attention", "paged_decode", "mla_decode_records")
BLOCK, PROMPT, NEW = 4, list(range(3, 14)), 3  # 11 prompt tokens over 3 blocks, 3 decodes
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="kvabi's C++ kernels not built")


def llama64(dtype: torch.dtype) -> LoadedModel:
    """A random Llama with head_dim 64 (the sizes every kernel and the fused decode take)."""
    config = ModelConfig(vocab_size=257, hidden_size=256, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=128,
                         eos_token_ids=(EOS,))  # fmt: skip
    torch.manual_seed(0)
    model = LlamaModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return LoadedModel(config, model.to(dtype).eval(), tiny_tokenizer())


def hf_model(make: Any, variant: str, folder: Any, dtype: str) -> LoadedModel:
    make(variant).save_pretrained(folder)
    write_tokenizer(folder)
    return load_model(folder, dtype, progress=False)


CASES = {  # name: (how to build the model, dtype, kv layout)
    "llama-bf16": ("llama", "bf16", "nhd"),
    "llama-fp32-hnd": ("llama", "fp32", "hnd"),
    "gemma4-shared-kv": ((test_gemma4.make_hf, "shared-kv"), "bf16", "nhd"),
    "laguna-per-head": ((test_laguna.make_hf, "per-head"), "bf16", "nhd"),
    "deepseek-mla": ((test_deepseek_v3.make_hf, "plain-512"), "bf16", "nhd"),
    "deepseek-fp8": ((test_deepseek_v3.make_hf, "plain-512"), "bf16", "vllm-fp8-ds-mla"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    how, dtype, layout = CASES[request.param]
    if how == "llama":
        loaded = llama64(torch.bfloat16 if dtype == "bf16" else torch.float32)
    else:
        loaded = hf_model(*how, tmp_path_factory.mktemp(request.param), dtype)
    config = EngineConfig(kv_layout=layout, block_size=BLOCK, num_blocks=32, fused_decode=False)
    return loaded, LLMEngine(loaded, config, fingerprint="t")


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    calls: Counter = Counter()
    for name in KERNELS:
        inner = getattr(CpuKernels, name)

        def counted(self, *args, _inner=inner, _name=name, **kwargs):
            calls[_name] += 1
            return _inner(self, *args, **kwargs)

        monkeypatch.setattr(CpuKernels, name, counted)
    return calls


def expected_calls(rows: Any, phase: str) -> Counter:
    want: Counter = Counter()
    for row in rows:
        path = getattr(row, phase)
        if path.kernel is not None:
            want[path.kernel.split(" ")[0].removeprefix("kvabi_")] += len(row.layer_ids)
    return want


@needs_kernels
def test_each_kernel_runs_for_exactly_the_layers_the_plan_gives_it(
    case: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded, engine = case
    rows = attention_paths(engine.info.descriptor, query_heads(loaded.config))
    assert sum(len(r.layer_ids) for r in rows) == sum(
        x.kind != "none" for x in engine.info.descriptor.model.layers
    )  # every layer with attention is planned once
    calls = count_kernel_calls(monkeypatch)
    engine.add_request(PROMPT, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    engine.step()  # the whole prompt: one prefill chunk per layer
    assert calls == expected_calls(rows, "prefill")
    for _ in range(NEW - 1):
        calls.clear()
        engine.step()  # one decode per layer
        assert calls == expected_calls(rows, "decode")


@needs_kernels
def test_fused_decode_gap_says_whether_the_engine_builds_one() -> None:
    """For a Llama whose sizes the fused decode takes: present exactly when the plan says
    nothing stands in its way (on this CPU: AMX or not); a hybrid or non-Llama plan says why."""
    for dtype in (torch.bfloat16, torch.float32):
        loaded = llama64(dtype)
        engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=32), "t")
        gap = fused_decode_gap(engine.info.descriptor, is_llama=True)
        assert (engine.runner.fused is None) == (gap is not None), gap
        assert fused_decode_gap(engine.info.descriptor, is_llama=False) is not None


def test_without_kernels_every_path_is_general_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvabi.engine.attention_plan as attention_plan

    monkeypatch.setattr(attention_plan, "cpu_kernels", lambda: None)
    loaded = llama64(torch.bfloat16)
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK, num_blocks=32), "t")
    rows = attention_paths(engine.info.descriptor, query_heads(loaded.config))
    for row in rows:
        for path in (row.prefill, row.decode):
            assert path.kernel is None and path.why.startswith("no native kernels"), path
    with pytest.raises(ValueError, match="query-head counts"):
        attention_paths(engine.info.descriptor, (4,))
