"""Router -> prefill (HND, 16-token blocks) -> decode (NHD, 32-token blocks) on Gemma 3 270M's
real weights (the bundled GGUF, fp32) with a prompt of over 700 tokens: the sliding layers'
512-token window has moved on, so the decode instance gets the full layers' every block and
the sliding layers' window only (kvabi/cache/group_blocks.py), and its greedy answer is the
colocated one.

The decode instance computes the prompt's last tokens alone, in GEMMs of other row counts than
the colocated prefill, so its logits differ by float rounding (fp32: ~1e-5 measured on this
model, tests/models/test_gemma3_gguf.py): the answer is compared exactly because every
colocated step's top-2 logprob margin is checked to exceed 1e-3.
"""

from __future__ import annotations

import pytest

from tests.disagg.processes import Instance, colocated_then_routed, min_top2_margin

pytestmark = [pytest.mark.slow, pytest.mark.big]
PARAGRAPH = (
    "The river town kept its records in a stone house by the bridge. Every spring the clerks "
    "copied the ledgers of grain, wool and salt, and every autumn they compared the copies "
    "with the barges that had come and gone. "
)
CHAT = {
    "messages": [{"role": "user", "content": PARAGRAPH * 16 + "What did the clerks copy?"}],
    "max_tokens": 16,
    "temperature": 0,
}
MODEL = ["--model", "gemma3-270m", "--dtype", "fp32", "--num-blocks", "1024"]


def test_gemma3_through_prefill_and_decode_matches_colocated():
    prefill = Instance(MODEL, "prefill", "hnd", 16)
    decode = Instance(MODEL, "decode", "nhd", 32, "--kv-peer", prefill.kv_address)
    want, got = colocated_then_routed(prefill, decode, CHAT, timeout_s=300)
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["message"]["content"]
    assert min_top2_margin(want) > 1e-3
    assert text == want["choices"][0]["message"]["content"] and text.strip()
    num_prompt = got.json()["usage"]["prompt_tokens"]
    assert num_prompt > 700
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // 32 * 32}"
