"""`kvabi router --hash-scheme`: the router indexes a vLLM deployment's KV events, which vLLM
0.32's own code hashed and encoded (tests/abi/vllm_hash_oracle.py in .venv-vllm), through the
real ZMQ subscriber and the prefix index, and sends a request to the instance that holds its
prefix. Only the prompt's token ids come from a stand-in tokenize endpoint."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from kvabi.abi.errors import HashSchemeError
from kvabi.connectors.vllm_handoff import VLLM_PYTHON
from kvabi.routing.prefix_routing import EventSource
from kvabi.routing.prompt_hashing import PromptHashing
from kvabi.routing.router import Router, RouterConfig
from tests.interop.vllm_marks import VLLM_MARKS

pytestmark = VLLM_MARKS
ORACLE = Path(__file__).parents[1] / "abi" / "vllm_hash_oracle.py"
HELD_BY_A = list(range(100, 112))  # 3 blocks of 4
HELD_BY_B = list(range(200, 212))
PROMPT = HELD_BY_A[:8] + [7, 7, 7, 7, 5]  # A holds its first 2 blocks, B none


def _vllm_events(
    tmp: Path, seed: str | None, int_hashes: bool, salt_of_a: str | None = None
) -> list[bytes]:
    salted = [{"t": [{"t": ["cache_salt", salt_of_a]}]}, None, None] if salt_of_a else None
    jobs = [
        {"op": "events", "algo": "sha256_cbor", "seed": seed, "block_size": 4,
         "token_ids": ids, "int_hashes": int_hashes, "extra_keys": extras}
        for ids, extras in ((HELD_BY_A, salted), (HELD_BY_B, None))
    ]  # fmt: skip
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(VLLM_PYTHON), str(ORACLE), str(tmp / "jobs.json"), str(tmp / "out.json")]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    return [bytes.fromhex(r[0]) for r in json.loads((tmp / "out.json").read_text())]


def _tokenizer(request: httpx.Request) -> httpx.Response:
    assert request.url.path == "/kvabi/tokenize/v1/completions"
    return httpx.Response(200, json={"token_ids": PROMPT, "hash_root": "00" * 32, "block_size": 4})


async def _route(router: Router, payloads: list[bytes], body: dict[str, Any]) -> dict[str, int]:
    ctx = zmq.Context.instance()
    pubs = [ctx.socket(zmq.PUB) for _ in payloads]
    for pub, source in zip(pubs, router.config.kv_events, strict=True):
        pub.bind(source.endpoint)
    router.routing.client = httpx.AsyncClient(transport=httpx.MockTransport(_tokenizer))
    router.routing.start()
    try:
        deadline = time.monotonic() + 10
        while sum(router.routing.index.num_blocks().values()) < 6:  # slow joiners: resend
            assert time.monotonic() < deadline, "the subscribers never saw vLLM's events"
            for seq, (pub, payload) in enumerate(zip(pubs, payloads, strict=True)):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.05)
        raw = json.dumps(body).encode()
        return await router.routing.cached_tokens("/v1/completions", raw, {})
    finally:
        router.routing.close()
        for pub in pubs:
            pub.close(linger=0)


def _router(hashing: PromptHashing, base_port: int) -> Router:
    urls = ("http://a", "http://b")
    sources = tuple(EventSource(u, f"tcp://127.0.0.1:{base_port + i}") for i, u in enumerate(urls))
    return Router(RouterConfig((), urls, kv_events=sources, hashing=hashing))


@pytest.mark.parametrize(
    ("scheme", "seed", "int_hashes", "port"),
    [("vllm-sha256-cbor", None, False, 26510), ("llm-d-sha256-cbor-64", "", True, 26520)],
)
def test_router_picks_the_vllm_instance_holding_the_prefix(
    tmp_path: Path, scheme: str, seed: str | None, int_hashes: bool, port: int
) -> None:
    payloads = _vllm_events(tmp_path, seed, int_hashes)
    router = _router(PromptHashing(scheme, seed), port)
    cached = asyncio.run(_route(router, payloads, {"prompt": "x"}))
    assert cached == {"http://a": 8, "http://b": 0}
    assert [u for u, _ in router.candidates(cached)] == ["http://a", "http://b"]


def test_the_kvabi_scheme_does_not_match_vllms_events(tmp_path: Path) -> None:
    payloads = _vllm_events(tmp_path, None, False)
    cached = asyncio.run(_route(_router(PromptHashing(), 26530), payloads, {"prompt": "x"}))
    assert cached == {"http://a": 0, "http://b": 0}


@pytest.mark.parametrize(("body_salt", "held"), [("tenant-a", 8), (None, 0), ("tenant-b", 0)])
def test_a_cache_salt_is_vllms_first_block_extra_key(
    tmp_path: Path, body_salt: str | None, held: int
) -> None:
    """vLLM hashed A's blocks for a request salted "tenant-a" (("cache_salt", salt) is an
    extra key of block 0): only a request with that salt has them as its prefix."""
    payloads = _vllm_events(tmp_path, None, False, salt_of_a="tenant-a")
    router = _router(PromptHashing("vllm-sha256-cbor"), 26540)
    body = {"prompt": "x"} | ({"cache_salt": body_salt} if body_salt else {})
    cached = asyncio.run(_route(router, payloads, body))
    assert cached == {"http://a": held, "http://b": 0}


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(HashSchemeError, match="unknown block-hash scheme"):
        PromptHashing("vllm-xxhash")
