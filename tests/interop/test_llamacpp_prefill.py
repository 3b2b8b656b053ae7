"""`LlamaCppPrefillProvider` in-process on the bundled GGUF: which blocks it sends, their
hashes, and that they hold llama.cpp's own K/V (f16, `pairs` order) unchanged."""

from __future__ import annotations

import pytest
import torch

from kvabi.abi.block_hash import hash_blocks, root_hash
from kvabi.abi.convert import read_planes
from kvabi.interop.foreign_prefill import LlamaCppPrefillProvider
from kvabi.interop.llamacpp_context import get_seq_state
from kvabi.interop.llamacpp_model import state_to_buffers
from kvabi.transfer.transport import FetchRequest
from tests.conftest import bundled_gguf_path

PROMPT = tuple(range(40, 77))  # 37 tokens: 4 blocks of 8 + 5


@pytest.fixture(scope="module")
def provider() -> LlamaCppPrefillProvider:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = bundled_gguf_path()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, verbose=False, n_threads=1)
    return LlamaCppPrefillProvider(llm, "test-fp", block_size=8, layout="vllm-flashinfer-hnd")


def test_descriptor_is_llamacpps_own_cache(provider):
    desc = provider.desc
    assert (desc.layout.name, desc.layout.block_size, desc.layout.dtype) == (
        "vllm-flashinfer-hnd",
        8,
        "f16",
    )
    assert (desc.model.fingerprint, desc.model.rope_pairing, desc.model.num_layers) == (
        "test-fp",
        "pairs",
        30,
    )


def test_sends_the_full_blocks_with_their_hashes(provider):
    payload = provider(FetchRequest(PROMPT))
    assert (payload.start_token, payload.end_token, payload.cache.extent) == (0, 32, 4)
    assert payload.token_ids == PROMPT[:32]
    root = root_hash(provider.spec.compat_digest(), None)
    assert list(payload.block_hashes) == hash_blocks(PROMPT[:32], 8, root)
    salted = provider(FetchRequest(PROMPT, cache_salt="tenant"))
    salted_root = root_hash(provider.spec.compat_digest(), {"cache_salt": "tenant"})
    assert list(salted.block_hashes) == hash_blocks(PROMPT[:32], 8, salted_root)
    assert set(salted.block_hashes).isdisjoint(payload.block_hashes)


def test_blocks_hold_llamacpps_kv_unchanged(provider):
    payload = provider(FetchRequest(PROMPT))
    own = state_to_buffers(get_seq_state(provider.llm), provider.spec)  # the 32 tokens it ate
    for layer in (0, 29):
        got, want = read_planes(payload.cache, layer, 32), read_planes(own, layer, 32)
        assert torch.equal(got["k"], want["k"]) and torch.equal(got["v"], want["v"])


def test_skips_the_blocks_the_asker_holds(provider):
    whole = provider(FetchRequest(PROMPT))
    tail = provider(FetchRequest(PROMPT, start_token=16))
    assert (tail.start_token, tail.end_token, tail.cache.extent) == (16, 32, 2)
    assert tail.block_hashes == whole.block_hashes[2:]
    for layer in (0, 29):
        got, want = read_planes(tail.cache, layer, 16), read_planes(whole.cache, layer, 32)
        assert torch.equal(got["k"], want["k"][16:]) and torch.equal(got["v"], want["v"][16:])


def test_nothing_to_send_runs_nothing(provider):
    provider.llm.reset()
    for request in (FetchRequest(PROMPT, start_token=32), FetchRequest(PROMPT[:7])):
        payload = provider(request)
        assert (payload.token_ids, payload.block_hashes, payload.cache.extent) == ((), (), 0)
    assert provider.llm.n_tokens == 0  # llama.cpp never evaluated
