"""Router -> prefill -> decode with real processes on DeepSeek V3.2 (issue 15, points 4 and 5): a
tiny random V3.2 in DeepSeek's cache geometry (latent 512 + rope 64, indexer keys of 128) whose
`index_topk` (8) is below the prompt (43), so every decode step attends to the latents its
indexer picks among the prompt's indexer keys: keys that did not arrive, or arrived wrong,
change the tokens (checked below by zeroing them).

The prefill instance keeps `vllm-mla` (fp32 [c_kv | k_pe]) with the indexer's sidecar plane
(fp8 + a scale per token, 132 bytes); decode instances in the same layout and in vLLM's
fp8_ds_mla records receive both planes over TCP (the records converted on receipt, the sidecar
moved byte for byte); a NIXL pair streams them layer by layer (`export_layer`).

Checked: the same-layout decode's greedy tokens equal the colocated run's; the fp8 decode's
equal an in-process vllm-mla engine's prompt KV converted to fp8 records and imported (exact,
as in test_disagg_mla.py: both sides compute the prompt the same way); the wire carries every
layer's indexer records bit-equal to the in-process export; a V3 peer (same latents, no
indexer) is refused at the handshake.
"""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from kvabi.abi.descriptor import Descriptor
from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.interop.model_spec import state_dict_fingerprint
from kvabi.models import load_model
from kvabi.transfer.errors import PeerIncompatibleError
from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest, KVPayload, TransportConfig
from tests.disagg.processes import SECRET, Instance, start_all, tiny_args
from tests.disagg.test_disagg_mla import BLOCK, BODY, FP8, PROMPT, completion, routed
from tests.disagg.tiny_peers import greedy
from tests.engine.test_v32_engine import REAL_LATENT
from tests.models.hf_reference import randomize
from tests.models.test_deepseek_v32 import HF_CONFIG
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")
NUM_NEW, TOPK = 12, 8


def v32_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**{**HF_CONFIG, **REAL_LATENT, "index_topk": TOPK})
    folder = tmp_path_factory.mktemp("v32")
    randomize(transformers.DeepseekV32ForCausalLM(config)).save_pretrained(folder)
    write_tokenizer(folder)  # one token per printable ASCII character, ids 0..93
    return str(folder)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    folder = v32_folder(tmp_path_factory)
    prefill = Instance(tiny_args(folder), "prefill", "nhd", BLOCK)
    peers = ("--kv-peer", prefill.kv_address)
    instances = {
        "prefill": prefill,
        "same": Instance(tiny_args(folder), "decode", "nhd", BLOCK, *peers),
        "fp8": Instance(tiny_args(folder), "decode", FP8, BLOCK, *peers),
    }
    start_all(list(instances.values()))
    yield folder, instances
    for i in instances.values():
        i.process.stop()


def text_of(tokens: list[int]) -> str:
    assert all(t < 94 for t in tokens)  # printable characters only: the text spells every token
    return "".join(chr(t + 33) for t in tokens)


def colocated(prefill: Instance) -> str:
    url = f"{prefill.url}/v1/completions"  # the prefill instance is a whole engine
    return completion(httpx.post(url, json=BODY, timeout=60))[0]


def engines(folder: str) -> tuple[LLMEngine, LLMEngine]:
    """In-process vllm-mla and fp8_ds_mla engines on the folder, fingerprinted as served."""
    loaded = load_model(folder, progress=False)
    fingerprint = state_dict_fingerprint(loaded.model.state_dict())
    return tuple(
        LLMEngine(loaded, EngineConfig(block_size=BLOCK, kv_layout=layout), fingerprint)
        for layout in ("nhd", FP8)
    )


def fetch(prefill: Instance, desc) -> tuple[KVPayload, object]:
    """The prompt's blocks from the prefill instance, asked for as a decode of `desc` would."""
    transport = TcpTransport(TransportConfig(SECRET.encode(), 10.0, 60.0))
    client = transport.connect(prefill.kv_address, desc)
    try:
        return client.fetch(FetchRequest(tuple(PROMPT))), client.peer_desc
    finally:
        client.close()


def test_same_layout_equals_colocated(fleet) -> None:
    _, instances = fleet
    want = colocated(instances["prefill"])
    got = routed(instances["prefill"], instances["same"])
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert text == want and len(text) == NUM_NEW
    assert instances["same"].free_blocks() == (128, 128)


def test_the_wire_carries_every_layers_indexer_records(fleet) -> None:
    folder, instances = fleet
    source, fp8 = engines(folder)
    want = greedy(source, PROMPT, NUM_NEW)
    exported = source.cache.export(PROMPT, None)
    payload, peer = fetch(instances["prefill"], fp8.info.descriptor)
    assert [x.indexer_dim for x in peer.model.layers] == [128] * 3
    num_tokens = len(PROMPT) // BLOCK * BLOCK
    assert len(payload.token_ids) == num_tokens
    for i in range(3):
        records = payload.cache.tensors[f"{i}.indexer"]  # [blocks, 4 tokens x 132] u8
        assert records.shape == (num_tokens // BLOCK, BLOCK * 132)
        assert torch.equal(records, exported.cache.tensors[f"{i}.indexer"])
    # the keys matter: the same payload with its indexer records zeroed continues otherwise
    zeroed = dict(payload.cache.tensors)
    for i in range(3):
        zeroed[f"{i}.indexer"] = torch.zeros_like(zeroed[f"{i}.indexer"])
    bad = KVPayload(0, payload.token_ids, payload.block_hashes, type(payload.cache)(peer, zeroed))
    other, _ = engines(folder)
    assert other.cache.import_blocks(PROMPT, None, bad).num_cached_tokens == num_tokens
    assert greedy(other, PROMPT, NUM_NEW) != want


def test_fp8_decode_equals_in_process_convert_import(fleet) -> None:
    folder, instances = fleet
    got = routed(instances["prefill"], instances["fp8"])
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    source, fp8 = engines(folder)
    greedy(source, PROMPT, NUM_NEW)
    exported = source.cache.export(PROMPT, None)
    placed = fp8.cache.import_blocks(PROMPT, None, exported)  # converted to records on import
    assert placed.num_cached_tokens == len(PROMPT) // BLOCK * BLOCK
    assert text == text_of(greedy(fp8, PROMPT, NUM_NEW))
    assert text != colocated(instances["prefill"])  # the records, not the fp32 blocks, decoded
    assert instances["fp8"].free_blocks() == (128, 128)


def test_a_v3_peer_is_refused_at_the_handshake(fleet) -> None:
    folder, instances = fleet
    _, fp8 = engines(folder)
    desc = fp8.info.descriptor
    # the same weights' fingerprint and latents, without the indexer plane: only it differs
    layers = tuple(replace(x, indexer_dim=0) for x in desc.model.layers)
    no_indexer = Descriptor(replace(desc.model, layers=layers), desc.layout)
    with pytest.raises(PeerIncompatibleError, match="indexer|layer"):
        fetch(instances["prefill"], no_indexer)


@pytest.mark.skipif(not is_nixl_available(), reason="nixl is not installed")
def test_nixl_reads_latents_and_indexer_out_of_the_prefill_pool(tmp_path_factory) -> None:
    """fp32 latents and indexer keys READ out of the prefill's pool into staging buffers,
    converted part by part into the decode pool's fp8 records."""
    folder = v32_folder(tmp_path_factory)
    nixl = ("--kv-transport", "nixl")
    prefill = Instance(tiny_args(folder), "prefill", "nhd", BLOCK, *nixl)
    decode = Instance(
        tiny_args(folder), "decode", FP8, BLOCK, "--kv-peer", prefill.kv_address, *nixl
    )
    start_all([prefill, decode])
    try:
        got = routed(prefill, decode)
        text, num_prompt = completion(got)
        tokens = num_prompt // BLOCK * BLOCK
        assert got.headers["x-kvabi-kv"] == f"prefill;tokens={tokens};via=pool-read"
        source, fp8 = engines(folder)
        greedy(source, PROMPT, NUM_NEW)
        fp8.cache.import_blocks(PROMPT, None, source.cache.export(PROMPT, None))
        assert text == text_of(greedy(fp8, PROMPT, NUM_NEW))
        assert decode.free_blocks() == (128, 128)
        assert prefill.settled_free_blocks() == (128, 128)
    finally:
        prefill.process.stop(), decode.process.stop()
