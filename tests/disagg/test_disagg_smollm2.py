"""Router -> prefill (HND, 16-token blocks) -> decode (NHD, 32-token blocks) on the bundled
SmolLM2: the greedy answer is the colocated one."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import bundled_gguf_path
from tests.disagg.processes import Instance, start_all, through_router

pytestmark = pytest.mark.slow
CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 24,
    "temperature": 0,
}


def test_smollm2_through_prefill_and_decode_matches_colocated():
    bundled_gguf_path()
    prefill = Instance([], "prefill", "hnd", 16)
    decode = Instance([], "decode", "nhd", 32, "--kv-peer", prefill.kv_address)
    try:
        start_all([prefill, decode])
        want = httpx.post(f"{prefill.url}/v1/chat/completions", json=CHAT, timeout=120).json()

        async def send(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post("/v1/chat/completions", json=CHAT)

        got = through_router([prefill], [decode], send)
    finally:
        prefill.process.stop(), decode.process.stop()
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["message"]["content"]
    assert text == want["choices"][0]["message"]["content"]
    assert "Paris" in text
    num_prompt = got.json()["usage"]["prompt_tokens"]
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // 32 * 32}"
