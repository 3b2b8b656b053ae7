"""Heterogeneous TP between prefill and decode, over real `kvabi serve` processes (issue 18,
point 3): SmolLM2 in fp32 (3 KV heads: 1 + 1 + 1 at TP 3, 2 + 1 at TP 2).

- prefill TP 3 -> decode TP 1 (another layout, HND): the prefill's rank 0 gathers each rank's
  heads of the prompt's blocks into whole blocks (kvabi/engine/tp_storage.py), sends them, and
  the decode converts them on import; over NIXL where it is installed, else TCP;
- prefill TP 1 -> decode TP 2 over TCP: the decode's rank 0 keeps its two heads of each block
  and sends its worker rank the third.

Each decode's text equals the colocated TP 1 run's. A prefill whose worker rank died sends
nothing: the decode instance prefills the prompt itself and says so.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from kvabi.transfer.nixl_memory import is_nixl_available
from tests.disagg.processes import Instance, start_all, through_router
from tests.parallel.test_tp_processes import MODEL, _children

pytestmark = pytest.mark.slow
BLOCK = 8
ARGS = ["--model", MODEL, "--served-model-name", "smol", "--dtype", "fp32", "--num-blocks", "64"]
PROMPT = (
    "The history of Paris begins in antiquity, when a Celtic tribe, the Parisii, settled on an "
    "island in the Seine. The Romans"
)
BODY = {"model": "smol", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
BODY |= {"ignore_eos": True}
TRANSPORT = "nixl" if is_nixl_available() else "tcp"


@pytest.fixture(scope="module")
def fleet():
    tp = "--tensor-parallel-size"
    nixl = ("--kv-transport", TRANSPORT)
    pre3 = Instance(ARGS, "prefill", "nhd", BLOCK, tp, "3", *nixl)
    pre1 = Instance(ARGS, "prefill", "nhd", BLOCK)
    instances = {
        "pre3": pre3,
        "dec1": Instance(ARGS, "decode", "hnd", BLOCK, "--kv-peer", pre3.kv_address, *nixl),
        "pre1": pre1,
        "dec2": Instance(ARGS, "decode", "nhd", BLOCK, "--kv-peer", pre1.kv_address, tp, "2"),
    }
    start_all(list(instances.values()))
    yield instances
    for i in instances.values():
        i.process.stop()


def routed(prefill: Instance, decode: Instance, body: dict = BODY) -> httpx.Response:
    async def send(client: httpx.AsyncClient) -> httpx.Response:
        response = await client.post("/v1/completions", json=body)
        await response.aread()
        return response

    return through_router([prefill], [decode], send)


def text_and_prompt_len(response: httpx.Response) -> tuple[str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def tp1_alone(fleet, body: dict = BODY) -> str:
    """TP 1 on its own (the TP 1 prefill instance is a whole engine)."""
    url = f"{fleet['pre1'].url}/v1/completions"
    return text_and_prompt_len(httpx.post(url, json=body, timeout=60))[0]


@pytest.fixture(scope="module")
def colocated(fleet) -> str:
    return tp1_alone(fleet)


@pytest.mark.parametrize("prefill,decode", [("pre3", "dec1"), ("pre1", "dec2")])
def test_decode_equals_colocated_tp1(fleet, colocated, prefill, decode) -> None:
    got = routed(fleet[prefill], fleet[decode])
    text, num_prompt = text_and_prompt_len(got)
    assert num_prompt >= 3 * BLOCK  # several blocks cross, each of every rank's heads
    assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // BLOCK * BLOCK}"
    assert text == colocated and len(text) > 0
    assert fleet[decode].free_blocks() == (64, 64)  # nothing leaked, nothing held


def test_a_prefill_whose_rank_died_leaves_the_decode_to_prefill(fleet) -> None:
    pre3 = fleet["pre3"]
    workers = _children(pre3.process.process.pid)
    assert len(workers) == 2
    for worker in workers:
        os.kill(worker, signal.SIGKILL)
    other = "Gustave Eiffel's company built the tower for the 1889 World's Fair, and at first"
    body = BODY | {"prompt": other}  # nothing of it cached on the decode instance
    got = routed(pre3, fleet["dec1"], body)
    text, _ = text_and_prompt_len(got)
    assert got.headers["x-kvabi-kv"].startswith("local;reason=")
    assert text == tp1_alone(fleet, body)
    assert fleet["dec1"].free_blocks() == (64, 64)
    health = httpx.get(f"{pre3.url}/health", timeout=5)
    assert health.status_code == 503  # the prefill instance says it is broken
