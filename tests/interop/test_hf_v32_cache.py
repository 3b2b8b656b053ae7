"""HF DynamicCache <-> kvabi for DeepSeek V3.2 (tiny random HF model, DeepSeek's cache geometry:
latent 512 + rope 64, indexer keys of 128): the latents and the indexer keys (the sidecar plane)
cross both ways; the engine's prefill continues in HF and HF's prefill continues in the engine.

`index_topk` (5) is below the prompt (17), so each query attends to the latents the indexer
picks: wrong or missing indexer keys change the picks. kvabi stores indexer keys as vLLM does
(fp8 + a scale per token) while HF keeps them unquantised, so the reference is HF with each new
indexer key rounded as vLLM stores it (`_hf_with_fp8_indexer_keys`, test_v32_engine.py): HF
scoring the keys a kvabi cache can hold. Tokens are compared on a prompt whose greedy margins
exceed twice the fp32 handoff tolerance (asserted); see test_hf_mla_cache.py for that tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvabi.abi.errors import MissingPlaneError
from kvabi.abi.indexer_record import encode_blocks
from kvabi.cache.block_api import FetchRequest, KVPayload
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.interop.errors import ModelMismatchError
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
from tests.engine.test_v32_engine import REAL_LATENT, _fp8_round, _hf_with_fp8_indexer_keys
from tests.interop.test_hf_mla_cache import HANDOFF_LOGIT_TOL
from tests.models.hf_reference import hf_greedy, randomize
from tests.models.test_deepseek_v32 import HF_CONFIG
from tests.models.test_registry import _write_tokenizer as write_tokenizer
from tests.models.tiny import random_ids

transformers = pytest.importorskip("transformers")
BLOCK, NUM_NEW, TOPK = 4, 10, 5
PROMPT_LEN = 17  # 16 tokens in full blocks, then the last prompt token HF (or kvabi) feeds


class Served:
    """The HF model, kvabi's load of its folder, a prompt, and HF on fp8-rounded indexer keys."""

    def __init__(self, folder: Path) -> None:
        torch.manual_seed(0)
        config = transformers.DeepseekV32Config(**{**HF_CONFIG, **REAL_LATENT, "index_topk": TOPK})
        self.hf = randomize(transformers.DeepseekV32ForCausalLM(config))
        self.hf.save_pretrained(folder)
        write_tokenizer(folder)
        self.loaded = load_model(folder, progress=False)
        self.fingerprint = state_dict_fingerprint(self.hf.state_dict())
        self.spec = model_spec_from_hf_config(self.hf.config, self.fingerprint)
        self.prompt = random_ids(PROMPT_LEN, seed=5)
        with _hf_with_fp8_indexer_keys():
            self.want, self.margins = hf_greedy(self.hf, self.prompt, NUM_NEW)

    def engine(self, layout: str = "vllm-mla") -> LLMEngine:
        config = EngineConfig(block_size=BLOCK, kv_layout=layout)
        return LLMEngine(self.loaded, config, self.fingerprint)

    def prefill_cache(self, num_tokens: int = PROMPT_LEN) -> Any:
        """HF's own cache after a forward over the first `num_tokens` prompt tokens."""
        with torch.no_grad():
            ids = self.prompt[None, :num_tokens]
            return output_cache(forward_with_cache(self.hf, ids, None))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return Served(tmp_path_factory.mktemp("v32-hf"))


@torch.no_grad()
def hf_continue(served: Served, cache: Any, token: int) -> list[int]:
    """Feed `token` after `cache`, then greedy (new indexer keys rounded as kvabi stores them)."""
    tokens = []
    with _hf_with_fp8_indexer_keys():
        for _ in range(NUM_NEW):
            outputs = forward_with_cache(served.hf, torch.tensor([[token]]), cache)
            cache, token = output_cache(outputs), int(outputs.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def test_spec_declares_the_indexer_plane(served: Served) -> None:
    layer = served.spec.layers[0]
    assert (layer.kind, layer.latent_dim, layer.rope_dim, layer.indexer_dim) == (
        "mla",
        512,
        64,
        128,
    )
    assert [p.name for p in layer.sidecar_planes] == ["indexer"]
    assert served.spec.layers == served.loaded.config.kv_layers()  # what the engine caches


def test_round_trip_holds_the_latents_and_rounds_the_indexer_keys(served: Served) -> None:
    cache = served.prefill_cache()
    buffers = dynamic_cache_to_buffers(cache, served.spec)
    assert (buffers.desc.layout.name, buffers.extent) == ("hf-dynamic-mla", PROMPT_LEN)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(buffers.tensors[f"{i}.latent"], layer.keys[0])
        records = buffers.tensors[f"{i}.indexer"]  # [T, 128 + 4] u8: vLLM's bytes per token
        assert records.shape == (PROMPT_LEN, 132) and records.dtype == torch.uint8
        assert torch.equal(records, encode_blocks(layer.indexer_keys[0], 1))
    back = buffers_to_dynamic_cache(buffers, served.hf.config, num_tokens=PROMPT_LEN - 3)
    for i, layer in enumerate(cache.layers):
        got, keys = back.layers[i].indexer_keys, layer.indexer_keys[:, : PROMPT_LEN - 3]
        assert got.shape == keys.shape and not torch.equal(got, keys)  # fp8, not the keys
        assert torch.equal(got, _fp8_round(keys))
        assert torch.equal(back.layers[i].keys, layer.keys[:, :, : PROMPT_LEN - 3])


def test_engine_prefill_continues_in_hf(served: Served) -> None:
    engine = served.engine()
    prompt = served.prompt.tolist()
    assert greedy(engine, prompt, NUM_NEW) == served.want  # the engine alone
    payload = engine.cache.export(prompt, None)  # 16 tokens: latents and indexer records
    n = len(payload.token_ids)
    assert n == PROMPT_LEN - 1 and "0.indexer" in payload.cache.tensors
    assert min(served.margins) > 2 * HANDOFF_LOGIT_TOL
    cache = buffers_to_dynamic_cache(payload.cache, served.hf.config, num_tokens=n)
    assert cache.get_seq_length() == n
    assert hf_continue(served, cache, prompt[-1]) == served.want
    # the keys matter: the same cache with each layer's indexer keys reversed in time
    # makes the indexer pick other latents, and HF continues otherwise
    shuffled = buffers_to_dynamic_cache(payload.cache, served.hf.config, num_tokens=n)
    for layer in shuffled.layers:
        layer.indexer_keys = layer.indexer_keys.flip(1)
    assert hf_continue(served, shuffled, prompt[-1]) != served.want


def test_hf_prefill_continues_in_engine(served: Served) -> None:
    """HF's prefill scoring fp8-rounded keys (as the reference does) continues in the engine
    with the reference's tokens."""
    provider = HFPrefillProvider(served.hf, served.fingerprint, BLOCK, layout="vllm-mla")
    prompt = served.prompt.tolist()
    with _hf_with_fp8_indexer_keys():
        payload = provider(FetchRequest(tuple(prompt)))  # HF's DynamicCache, re-blocked
    assert len(payload.token_ids) == PROMPT_LEN - 1 and "2.indexer" in payload.cache.tensors
    engine = served.engine()
    assert engine.cache.import_blocks(prompt, None, payload).num_cached_tokens == PROMPT_LEN - 1
    assert greedy(engine, prompt, NUM_NEW) == served.want
    assert engine.cache_stats()["prefix_hit_tokens"] == PROMPT_LEN - 1  # HF's blocks were used


def test_plain_hf_prefill_continues_in_engine_as_in_hf(served: Served) -> None:
    """Plain HF's prefill (unquantised keys, so its sparse picks over the prompt, then its
    latents, differ from the reference's) continues in the engine as in HF from the same cache
    state: the latents HF computed, the indexer keys as kvabi holds them."""
    provider = HFPrefillProvider(served.hf, served.fingerprint, BLOCK, layout="vllm-mla")
    prompt = served.prompt.tolist()
    payload = provider(FetchRequest(tuple(prompt)))
    engine = served.engine()
    assert engine.cache.import_blocks(prompt, None, payload).num_cached_tokens == PROMPT_LEN - 1
    got = greedy(engine, prompt, NUM_NEW)
    held = dynamic_cache_to_buffers(served.prefill_cache(PROMPT_LEN - 1), served.spec)
    cache = buffers_to_dynamic_cache(held, served.hf.config)
    want = hf_continue(served, cache, prompt[-1])
    assert got == want and want != served.want  # the picks over the prompt mattered


def test_hf_prefill_into_fp8_records(served: Served) -> None:
    """HF's cache into an fp8_ds_mla engine: the indexer records go across byte for byte."""
    provider = HFPrefillProvider(served.hf, served.fingerprint, BLOCK, layout="vllm-mla")
    prompt = served.prompt.tolist()
    payload = provider(FetchRequest(tuple(prompt)))
    engine = served.engine("vllm-fp8-ds-mla")
    assert engine.cache.import_blocks(prompt, None, payload).num_cached_tokens == PROMPT_LEN - 1
    back = engine.cache.export(prompt, None)
    for i in range(served.spec.num_layers):
        key = f"{i}.indexer"
        assert torch.equal(back.cache.tensors[key], payload.cache.tensors[key])


def test_refusals(served: Served) -> None:
    cache = served.prefill_cache(8)
    v3_config = transformers.DeepseekV3Config(**{
        k: v for k, v in served.hf.config.to_dict().items()
        if not k.startswith("index") and k not in ("model_type", "layer_types")
    })  # fmt: skip
    v3_spec = model_spec_from_hf_config(v3_config)
    assert v3_spec.layers[0].indexer_dim == 0
    with pytest.raises(ModelMismatchError, match="indexer keys"):  # V3.2's cache read as V3's
        dynamic_cache_to_buffers(cache, v3_spec)
    for layer in cache.layers:  # a V3.2 cache whose indexer keys are gone: never half-read
        layer.indexer_keys = None
    with pytest.raises(MissingPlaneError, match="'indexer'"):
        dynamic_cache_to_buffers(cache, served.spec)
    buffers = dynamic_cache_to_buffers(served.prefill_cache(8), served.spec)
    with pytest.raises(ModelMismatchError, match="geometry"):  # V3.2 buffers into a V3 cache
        buffers_to_dynamic_cache(buffers, v3_config)
    without = {k: t for k, t in buffers.tensors.items() if not k.endswith("indexer")}
    with pytest.raises(MissingPlaneError):
        type(buffers)(buffers.desc, without)


def test_payload_without_the_plane_pools_nothing(served: Served) -> None:
    provider = HFPrefillProvider(served.hf, served.fingerprint, BLOCK, layout="vllm-mla")
    prompt = served.prompt.tolist()
    payload = provider(FetchRequest(tuple(prompt)))
    engine = served.engine()
    free = engine.cache.pool.num_free
    stripped = dict(payload.cache.tensors)
    del stripped["1.indexer"]
    with pytest.raises(MissingPlaneError):
        bad = type(payload.cache)(payload.cache.desc, stripped)
        engine.cache.import_blocks(prompt, None, KVPayload(0, payload.token_ids, (), bad))
    assert engine.cache.pool.num_free == free
