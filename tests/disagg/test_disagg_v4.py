"""Router -> prefill -> decode with real processes on DeepSeek V4 (issue 19, point 3): the "tiny"
random V4 of tests/models/test_deepseek_v4.py (sliding, CSA m = 4 with its indexer, HCA m' = 8),
blocks of 8 tokens. The prefill instance sends the prompt's whole blocks: each layer's window
of K=V rows, each compressed layer's entries (and the indexer's) and the CSA compressor's state
at each block's end; the decode instance computes the prompt's last 3 tokens from there (its
compressors restored from the last block's state record) and decodes.

Over TCP and, where it is installed, NIXL (layer by layer: the entries' layers follow the
attention layers). Each decode's text equals the colocated run's, which equals HF's greedy.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from kvabi.transfer.nixl_memory import is_nixl_available
from tests.disagg.processes import Instance, start_all, tiny_args
from tests.disagg.test_disagg_mla import BODY, NUM_NEW, PROMPT, completion, routed
from tests.models.hf_reference import FP32_LOGIT_TOL, hf_greedy
from tests.models.test_deepseek_v4 import make_hf
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")
BLOCK = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    folder = str(tmp_path_factory.mktemp("v4"))
    hf = make_hf("tiny")
    hf.save_pretrained(folder)
    write_tokenizer(folder)  # one token per printable ASCII character, ids 0..93
    tokens, margins = hf_greedy(hf, torch.tensor(PROMPT), NUM_NEW)
    assert min(margins) > 2 * FP32_LOGIT_TOL
    args = tiny_args(folder)
    tcp = Instance(args, "prefill", "nhd", BLOCK)
    instances = {
        "tcp": (tcp, Instance(args, "decode", "nhd", BLOCK, "--kv-peer", tcp.kv_address)),
    }
    if is_nixl_available():
        nixl = ("--kv-transport", "nixl")
        pre = Instance(args, "prefill", "nhd", BLOCK, *nixl)
        instances["nixl"] = (
            pre,
            Instance(args, "decode", "nhd", BLOCK, "--kv-peer", pre.kv_address, *nixl),
        )
    start_all([i for pair in instances.values() for i in pair])
    yield "".join(chr(t + 33) for t in tokens), instances
    for pair in instances.values():
        for i in pair:
            i.process.stop()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_decode_equals_colocated_and_hf(fleet, transport: str) -> None:
    hf_text, instances = fleet
    if transport not in instances:
        pytest.skip("nixl is not installed")
    prefill, decode = instances[transport]
    url = f"{prefill.url}/v1/completions"
    colocated = completion(httpx.post(url, json=BODY, timeout=60))[0]
    assert colocated == hf_text
    got = routed(prefill, decode)
    text, num_prompt = completion(got)
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert text == colocated and len(text) == NUM_NEW
    assert decode.free_blocks() == (3 * 128, 3 * 128)  # 3 pools: nothing leaked, nothing held
