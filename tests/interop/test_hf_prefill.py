"""HF transformers as the prefill engine, kvabi as the decode engine, over the TCP transport:
greedy output identical to HF alone."""

from __future__ import annotations

import pytest
import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.interop.foreign_prefill import HFPrefillProvider
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest
from tests.disagg.tiny_peers import config, greedy
from tests.engine.tiny import greedy_reference
from tests.server.tiny_server import chat_loaded, tiny_folder

transformers = pytest.importorskip("transformers")
PROMPT = tuple(range(40, 77))  # 37 tokens: 4 blocks of 8 + 5


def test_hf_prefill_feeds_kvabi_decode_identically(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_folder(tmp_path), dtype=torch.float32
    )
    provider = HFPrefillProvider(hf, "tiny", block_size=8, layout="vllm-flashinfer-hnd")
    server = TcpTransport(config()).listen("127.0.0.1:0", provider.desc, provider)
    decode = LLMEngine(chat_loaded(), EngineConfig(block_size=16, num_blocks=64), "tiny")
    client = TcpTransport(config()).connect(server.address, decode.info.descriptor)
    payload = client.fetch(FetchRequest(PROMPT))
    assert (payload.start_token, payload.end_token, payload.cache.extent) == (0, 32, 4)
    assert decode.cache.import_blocks(PROMPT, None, payload).num_cached_tokens == 32
    got = greedy(decode, list(PROMPT), 10)
    assert decode.cache_stats()["prefix_hit_tokens"] == 32
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
    # HF computes the same logits in other kernels (fp32, ~5e-6 apart): exact because the
    # tokens' margins are clear of that (tests/engine/tiny.py)
    assert got == out[0, len(PROMPT) :].tolist() == list(greedy_reference(PROMPT, 10))
    client.close(), server.close()
