"""Router -> prefill (HND, 16-token blocks) -> decode (NHD, 32-token blocks) on the bundled
SmolLM2: the greedy answer is the colocated one.

The fetched blocks are the prefill instance's K/V bit for bit, but the decode instance computes
the prompt's tail alone, in bf16 GEMMs of other row counts than the colocated prefill: its
logits may round an ulp apart (0.125 at |logit| 16-32; the engine's and a contiguous forward's
first logits were measured one ulp apart). So the answer is compared exactly only because
every colocated step's top-2 margin is checked to exceed 2 ulps ("What is the capital of
France?" alone has a first step 2 ulps wide; asking for one word makes every step >= 4).
"""

from __future__ import annotations

import pytest

from tests.conftest import bundled_gguf_path
from tests.disagg.processes import Instance, colocated_then_routed, min_top2_margin

pytestmark = pytest.mark.slow
CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "max_tokens": 24,
    "temperature": 0,
}
BF16_LOGIT_ULP = 0.125  # at |logit| in [16, 32), where this answer's top logits are


def test_smollm2_through_prefill_and_decode_matches_colocated():
    bundled_gguf_path()
    prefill = Instance([], "prefill", "hnd", 16)
    decode = Instance([], "decode", "nhd", 32, "--kv-peer", prefill.kv_address)
    want, got = colocated_then_routed(prefill, decode, CHAT, timeout_s=120)
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["message"]["content"]
    assert min_top2_margin(want) > 2 * BF16_LOGIT_ULP
    assert text == want["choices"][0]["message"]["content"]
    assert "Paris" in text
    num_prompt = got.json()["usage"]["prompt_tokens"]
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // 32 * 32}"
