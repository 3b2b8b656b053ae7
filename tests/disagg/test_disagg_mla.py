"""Router -> prefill -> decode with real processes on MLA: a tiny random DeepSeek-V3 (plain-512:
DeepSeek's 512 + 64 latent geometry) served by a prefill instance in `vllm-mla` (fp32
[c_kv | k_pe] per token) and by decode instances in the same layout and in vLLM's fp8_ds_mla
records (656 bytes a token), which converts the prefill's blocks on receipt.

Same layout: greedy output equal to the colocated run. fp8 decode: equal to what an in-process
fp8 engine makes of the same prompt KV, computed here as the brief states it: a `vllm-mla`
engine's export, `convert`ed to the fp8 engine's descriptor, imported, greedy. That is exact,
not a tolerance: the prefill instance and the in-process engine compute the prompt's latents by
the same code on the same shapes (fp32, whole-prompt forward), the encoder is deterministic, and
both fp8 engines then compute the prompt's partial block and decode from equal records (were a
CPU's GEMMs to round by thread count, the latents, then the records, could differ in a bit: the
test would fail, not pass wrongly). On this prompt the fp8 text differs from the fp32 colocated
one (asserted), so the check tells a decode over the records from one over the fp32 blocks.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvabi.abi.convert import convert
from kvabi.cache.block_api import KVPayload
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.models import load_model
from tests.disagg.processes import Instance, start_all, through_router, tiny_args
from tests.disagg.tiny_peers import greedy
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")
BLOCK, NUM_NEW = 4, 12
# token ids: the tokenizer's id of a printable ASCII character c is ord(c) - 33
# 43 tokens; on this prompt fp8 records move greedy off the fp32 run at the 6th token (measured),
# so the fp8 comparison tells a decode over records from one over the fp32 blocks
PROMPT = [ord(c) - 33 for c in "0123456789abcdefghijklmnopqrstuvwxyzABCDEFG"]
FP8 = "vllm-fp8-ds-mla"


def deepseek_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.models.test_deepseek_v3 import make_hf

    folder = tmp_path_factory.mktemp("deepseek")
    make_hf("plain-512").save_pretrained(folder)
    write_tokenizer(folder)  # one token per printable ASCII character, ids 0..93
    return str(folder)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    folder = deepseek_folder(tmp_path_factory)
    args = tiny_args(folder)
    prefill = Instance(args, "prefill", "nhd", BLOCK)
    peers = ("--kv-peer", prefill.kv_address)
    instances = {
        "prefill": prefill,
        "same": Instance(args, "decode", "nhd", BLOCK, *peers),
        "fp8": Instance(args, "decode", FP8, BLOCK, *peers),
    }
    start_all(list(instances.values()))
    yield folder, instances
    for i in instances.values():
        i.process.stop()


BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": NUM_NEW, "temperature": 0}
BODY |= {"ignore_eos": True}


def completion(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def routed(prefill: Instance, decode: Instance, body: dict = BODY) -> httpx.Response:
    async def send(client: httpx.AsyncClient) -> httpx.Response:
        response = await client.post("/v1/completions", json=body)
        await response.aread()
        return response

    return through_router([prefill], [decode], send)


def fp8_reference(folder: str, prompt: list[int], dtype: str = "fp32") -> list[int]:
    """An fp8_ds_mla engine's greedy tokens after importing a vllm-mla engine's prompt KV,
    converted to the fp8 engine's records; both engines' weights (and the vllm-mla KV) in
    `dtype`."""
    loaded = load_model(folder, dtype=dtype, progress=False)
    source = LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout="nhd"))
    greedy(source, prompt, NUM_NEW)
    exported = source.cache.export(prompt, None)  # the prompt's full blocks, [c_kv | k_pe]
    target = LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout=FP8))
    desc = target.info.descriptor
    assert (exported.cache.desc.layout.name, desc.layout.name) == ("vllm-mla", FP8)
    records = convert(exported.cache, desc, num_tokens=len(exported.token_ids))
    payload = KVPayload(0, exported.token_ids, exported.block_hashes, records)
    placed = target.cache.import_blocks(prompt, None, payload)
    assert placed.num_cached_tokens == len(prompt) // BLOCK * BLOCK
    tokens = greedy(target, prompt, NUM_NEW)
    assert target.cache_stats()["prefix_hit_tokens"] == placed.num_cached_tokens
    return tokens


def colocated(instances: dict[str, Instance]) -> str:
    url = f"{instances['prefill'].url}/v1/completions"  # the prefill instance is a whole engine
    return completion(httpx.post(url, json=BODY, timeout=60))[0]


def test_same_layout_equals_colocated(fleet) -> None:
    """The decode instance computes only the prompt's last 3 tokens over the received blocks,
    the colocated run all 43: their logits round apart (fp32), so the texts are compared exactly
    only because HF's greedy steps on this prompt have no near-tie (asserted)."""
    from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy
    from tests.models.test_deepseek_v3 import make_hf

    _, instances = fleet
    tokens, margins = hf_greedy(make_hf("plain-512"), torch.tensor(PROMPT), NUM_NEW)
    assert min(margins) > 2 * FP32_LOGIT_TOL
    want = colocated(instances)
    assert want == "".join(chr(t + 33) for t in tokens)
    got = routed(instances["prefill"], instances["same"])
    text, num_prompt = completion(got)
    assert text == want and len(text) == NUM_NEW
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"


def test_fp8_decode_equals_in_process_fp8_import(fleet) -> None:
    folder, instances = fleet
    got = routed(instances["prefill"], instances["fp8"])
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert num_prompt == len(PROMPT)
    want = fp8_reference(folder, PROMPT)
    assert all(t < 94 for t in want)  # printable characters only: the text spells every token
    assert text == "".join(chr(t + 33) for t in want)
    assert text != colocated(instances)  # the fp8 records, not the fp32 blocks, were decoded
    assert instances["fp8"].free_blocks() == (128, 128)  # nothing leaked, nothing held
