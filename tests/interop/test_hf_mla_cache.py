"""HF DynamicCache <-> kvabi for MLA (tiny random DeepSeek-V3, both configs): the kvabi engine's
exported latents continue in HF, and HF's prefill continues in the kvabi engine, each greedy
equal to HF alone; attention caches offered as MLA and the reverse are refused.

Tolerance: HF continuing from the engine's `vllm-mla` blocks sees latents that differ from its
own by the engine's absorbed-attention rounding (<= 2.6e-6 on later layers, layer 0 exact;
test_mla_engine.py). The next-token logits then differ from HF alone by max |d| measured 1.7e-6
(lora-yarn) and 1.5e-6 (plain-512) on a 2-core x86 CPU; HANDOFF_LOGIT_TOL = 1e-5 leaves ~6x.
Greedy tokens are asserted equal with every step's top-2 margin above twice the tolerance
(asserted; the smallest margins measured are 2.4e-4 and 2.1e-2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.convert import convert
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_api import FetchRequest
from kvabi.engine.engine import EngineConfig, LLMEngine, model_spec
from kvabi.interop.errors import InteropError, ModelMismatchError
from kvabi.interop.foreign_prefill import HFPrefillProvider
from kvabi.interop.hf_cache import (
    buffers_to_dynamic_cache,
    dynamic_cache_to_buffers,
    forward_with_cache,
    output_cache,
)
from kvabi.interop.model_spec import model_spec_from_hf_config, state_dict_fingerprint
from kvabi.models import load_model
from tests.disagg.tiny_peers import greedy
from tests.models import test_deepseek_v3
from tests.models.hf_reference import hf_greedy
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
BLOCK, NUM_NEW = 4, 10
PROMPT_LEN = 17  # 16 tokens in full blocks, then the last prompt token HF (or kvabi) feeds
HANDOFF_LOGIT_TOL = 1e-5  # measured <= 1.7e-6, module docstring


class Served:
    """One config: the HF model, kvabi's load of its folder, a prompt and HF alone on it."""

    def __init__(self, variant: str, folder: Path) -> None:
        self.hf = test_deepseek_v3.make_hf(variant)
        self.hf.save_pretrained(folder)
        write_tokenizer(folder)
        self.loaded = load_model(folder, progress=False)
        self.fingerprint = state_dict_fingerprint(self.hf.state_dict())
        self.spec = model_spec_from_hf_config(self.hf.config, self.fingerprint)
        self.prompt = random_ids(PROMPT_LEN, seed=5)
        self.want, self.margins = hf_greedy(self.hf, self.prompt, NUM_NEW)
        with torch.no_grad():
            self.want_logits = self.hf(self.prompt[None]).logits[0, -1]

    def engine(self, layout: str = "nhd") -> LLMEngine:
        config = EngineConfig(block_size=BLOCK, kv_layout=layout)
        return LLMEngine(self.loaded, config, self.fingerprint)


@pytest.fixture(scope="module", params=sorted(test_deepseek_v3.CONFIGS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(request.param, tmp_path_factory.mktemp(request.param))


@torch.no_grad()
def hf_continue(hf: Any, cache: Any, token: int) -> tuple[torch.Tensor, list[int]]:
    """Feed `token` after `cache`, then greedy: the first step's logits and all tokens."""
    first, tokens = None, []
    for _ in range(NUM_NEW):
        outputs = forward_with_cache(hf, torch.tensor([[token]]), cache)
        cache, logits = output_cache(outputs), outputs.logits[0, -1]
        first = logits if first is None else first
        token = int(logits.argmax())
        tokens.append(token)
    return first, tokens


def test_spec_is_the_engines(served: Served) -> None:
    assert served.spec == model_spec(served.loaded, served.fingerprint)
    cfg = served.hf.config
    layer = served.spec.layers[0]
    assert (layer.kind, layer.latent_dim, layer.rope_dim) == (
        "mla", cfg.kv_lora_rank, cfg.qk_rope_head_dim
    )  # fmt: skip


def test_other_latent_models_are_refused() -> None:
    """DeepSeek-V2 caches expanded keys: not read as V3's two planes (V3.2's latents and
    indexer keys map: test_hf_v32_cache.py)."""
    config = transformers.DeepseekV2Config()
    with pytest.raises(InteropError, match=config.model_type):
        model_spec_from_hf_config(config)


def test_export_is_the_cache(served: Served) -> None:
    with torch.no_grad():
        cache = output_cache(forward_with_cache(served.hf, served.prompt[None], None))
    buffers = dynamic_cache_to_buffers(cache, served.spec)
    assert (buffers.desc.layout.name, buffers.extent) == ("hf-dynamic-mla", PROMPT_LEN)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(buffers.tensors[f"{i}.latent"], layer.keys[0])  # [1, T, rank]
        assert torch.equal(buffers.tensors[f"{i}.rope"], layer.values[0])  # [1, T, rope]
    back = buffers_to_dynamic_cache(buffers, served.hf.config, num_tokens=PROMPT_LEN - 3)
    assert torch.equal(back.layers[1].keys, cache.layers[1].keys[:, :, : PROMPT_LEN - 3])


def test_engine_prefill_continues_in_hf(served: Served) -> None:
    engine = served.engine()
    prompt = served.prompt.tolist()
    assert greedy(engine, prompt, NUM_NEW) == served.want  # the engine alone
    payload = engine.cache.export(prompt, None)  # [c_kv | k_pe] of the 16 full-block tokens
    n = len(payload.token_ids)
    assert n == PROMPT_LEN - 1 and payload.cache.desc.layout.name == "vllm-mla"
    cache = buffers_to_dynamic_cache(payload.cache, served.hf.config, num_tokens=n)
    assert cache.get_seq_length() == n
    logits, tokens = hf_continue(served.hf, cache, prompt[-1])
    torch.testing.assert_close(logits, served.want_logits, atol=HANDOFF_LOGIT_TOL, rtol=0)
    assert min(served.margins) > 2 * HANDOFF_LOGIT_TOL
    assert tokens == served.want


def test_hf_prefill_continues_in_engine(served: Served) -> None:
    provider = HFPrefillProvider(served.hf, served.fingerprint, BLOCK, layout="vllm-mla")
    prompt = served.prompt.tolist()
    payload = provider(FetchRequest(tuple(prompt)))  # HF's DynamicCache, re-blocked
    assert len(payload.token_ids) == PROMPT_LEN - 1
    engine = served.engine()
    placed = engine.cache.import_blocks(prompt, None, payload)
    assert placed.num_cached_tokens == PROMPT_LEN - 1
    assert greedy(engine, prompt, NUM_NEW) == served.want
    assert engine.cache_stats()["prefix_hit_tokens"] == PROMPT_LEN - 1  # HF's blocks were used


def test_refuses_attention_caches_as_mla_and_the_reverse(served: Served) -> None:
    llama = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_hidden_layers=served.spec.num_layers,
    )  # fmt: skip
    attn_spec = model_spec_from_hf_config(llama)
    torch.manual_seed(0)
    attn_hf = transformers.LlamaForCausalLM(llama).eval()
    ids = served.prompt[None, :8]
    with torch.no_grad():
        attn_cache = output_cache(forward_with_cache(attn_hf, ids, None))
        mla_cache = output_cache(forward_with_cache(served.hf, ids, None))
    with pytest.raises(ModelMismatchError, match="mla layer caches"):
        dynamic_cache_to_buffers(attn_cache, served.spec)
    with pytest.raises(ModelMismatchError, match="attn layer caches"):
        dynamic_cache_to_buffers(mla_cache, attn_spec)
    mla_buffers = dynamic_cache_to_buffers(mla_cache, served.spec)
    with pytest.raises(ModelMismatchError, match="geometry"):
        buffers_to_dynamic_cache(mla_buffers, llama)
    with pytest.raises(ModelMismatchError, match="geometry"):
        buffers_to_dynamic_cache(dynamic_cache_to_buffers(attn_cache, attn_spec), served.hf.config)
    # another MLA geometry: a rope plane one wider
    wide = transformers.DeepseekV3Config(
        **{**served.hf.config.to_dict(), "qk_rope_head_dim": served.spec.layers[0].rope_dim + 2}
    )
    with pytest.raises(ModelMismatchError, match="geometry"):
        buffers_to_dynamic_cache(mla_buffers, wide)
    with pytest.raises(ModelMismatchError, match=r"caches \[\(1, "):
        dynamic_cache_to_buffers(mla_cache, model_spec_from_hf_config(wide))


def test_fp8_records_dequantise_into_hf(served: Served) -> None:
    """An fp8_ds_mla cache maps to HF as float32 latents: fp8's rounding, not garbage."""
    layer = served.spec.layers[0]
    if (layer.latent_dim, layer.rope_dim) != (512, 64):
        pytest.skip("fp8_ds_mla records are for kv_lora_rank 512 + rope 64")
    with torch.no_grad():
        cache = output_cache(forward_with_cache(served.hf, served.prompt[None], None))
    buffers = dynamic_cache_to_buffers(cache, served.spec)
    fp8 = preset_descriptor("vllm-fp8-ds-mla", served.spec, block_size=BLOCK)
    records = convert(buffers, fp8, num_tokens=PROMPT_LEN)
    back = buffers_to_dynamic_cache(records, served.hf.config, num_tokens=PROMPT_LEN)
    got, want = back.layers[1].keys[0, 0], cache.layers[1].keys[0, 0]  # [T, 512]
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    scale = want.unflatten(-1, (4, 128)).abs().amax(-1, keepdim=True) / 448  # per 128-tile
    bound = 2**-4 * want.abs() + 2**-9 * scale.expand(-1, 4, 128).flatten(-2)  # docs/ABI.md 3.3
    assert bool(((got - want).abs() <= bound).all())
    rope = cache.layers[1].values
    assert torch.equal(back.layers[1].values, rope.bfloat16().float())  # k_pe is stored bf16
