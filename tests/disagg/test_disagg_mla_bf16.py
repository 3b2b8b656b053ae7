"""Router -> prefill -> decode with real processes on MLA in bf16 (issue 15, point 5): the tiny
random DeepSeek-V3 of test_disagg_mla.py (plain-512: 512 + 64 latent geometry), every instance
with `--dtype bf16`; the prefill instance in `vllm-mla` (576 bf16 values = 1,152 bytes a token
a layer), decode instances in the same layout and in vLLM's fp8_ds_mla records (656 bytes a
token a layer), which converts the prefill's bf16 blocks on receipt.

Checked: (a) the same-layout decode's greedy tokens and logprobs equal the colocated run's;
(b) the fp8 decode's tokens equal an in-process bf16 `vllm-mla` engine's prompt KV exported,
`convert`ed to the fp8 engine's descriptor, imported and decoded greedily; (c) what the prefill
instance puts on the wire to an fp8_ds_mla peer is bf16 576 (its handshake descriptor and a
fetched payload: 1,152 bytes a token a layer), bit-equal to the in-process bf16 engine's export.
(c) is also why (b) can be exact: both sides compute the prompt's latents by the same code on
the same shapes with the same thread count (torch's default, the machine's cores, in both
processes: neither sets it), so the records the two fp8 engines decode from are equal.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.interop.model_spec import state_dict_fingerprint
from kvabi.models import load_model
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest, TransportConfig
from tests.disagg.processes import SECRET, Instance, start_all, tiny_args
from tests.disagg.test_disagg_mla import (
    BLOCK,
    BODY,
    FP8,
    NUM_NEW,
    PROMPT,
    completion,
    deepseek_folder,
    fp8_reference,
    routed,
)
from tests.disagg.tiny_peers import greedy

LOGPROBS = BODY | {"logprobs": 2}  # the sampled token's logprob and the top 2, each step


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    folder = deepseek_folder(tmp_path_factory)
    args = tiny_args(folder, dtype="bf16")
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


def colocated(instances: dict[str, Instance]) -> dict:
    url = f"{instances['prefill'].url}/v1/completions"  # the prefill instance is a whole engine
    response = httpx.post(url, json=LOGPROBS, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_same_layout_equals_colocated(fleet) -> None:
    _, instances = fleet
    want = colocated(instances)
    got = routed(instances["prefill"], instances["same"], LOGPROBS)
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert text == want["text"] and len(text) == NUM_NEW
    # bit-equal logprobs, top 2 included: the 3-token tail over the received blocks rounds as
    # the 43-token forward does (measured here; were bf16 GEMMs to round by row count, this
    # would fail rather than pass wrongly)
    assert got.json()["choices"][0]["logprobs"] == want["logprobs"]


def test_prefill_sends_bf16_576(fleet) -> None:
    folder, instances = fleet
    loaded = load_model(folder, dtype="bf16", progress=False)
    source = LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout="nhd"))
    greedy(source, PROMPT, NUM_NEW)
    exported = source.cache.export(PROMPT, None)
    fingerprint = state_dict_fingerprint(loaded.model.state_dict())  # as `kvabi serve` has it
    fp8 = LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout=FP8), fingerprint)
    transport = TcpTransport(TransportConfig(SECRET.encode(), 10.0, 60.0))
    client = transport.connect(
        instances["prefill"].kv_address, fp8.info.descriptor
    )  # as the fp8 decode does
    try:
        payload = client.fetch(FetchRequest(tuple(PROMPT)))
    finally:
        client.close()
    peer = client.peer_desc
    assert (peer.layout.name, peer.layout.dtype) == ("vllm-mla", "bf16")
    assert payload.cache.desc == peer
    assert (
        peer.layout == exported.cache.desc.layout
        and peer.model.layers == fp8.info.descriptor.model.layers
    )
    num_tokens, num_layers = len(PROMPT) // BLOCK * BLOCK, len(payload.cache.tensors)
    assert (len(payload.token_ids), num_layers) == (num_tokens, 2)
    assert payload.cache.num_bytes == num_tokens * num_layers * 1152  # 576 bf16 values
    for name, t in payload.cache.tensors.items():
        assert (t.shape[-1], t.dtype) == (576, torch.bfloat16)
        assert (
            t.view(-1)
            .view(torch.int16)
            .equal(exported.cache.tensors[name].view(-1).view(torch.int16))
        )


def test_fp8_decode_equals_in_process_bf16_convert_import(fleet) -> None:
    folder, instances = fleet
    got = routed(instances["prefill"], instances["fp8"])
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert num_prompt == len(PROMPT)
    want = fp8_reference(folder, PROMPT, dtype="bf16")
    assert all(t < 94 for t in want)  # printable characters only: the text spells every token
    assert text == "".join(chr(t + 33) for t in want)
    # on this prompt the records move greedy off the bf16 run at the 6th token (measured), so
    # this tells a decode over the fp8 records from one over the bf16 blocks
    assert text != colocated(instances)["text"]
    assert instances["fp8"].free_blocks() == (128, 128)  # nothing leaked, nothing held
