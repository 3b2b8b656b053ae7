"""Real `kvabi serve --role` processes on the tiny chat model, and the router in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from kvabi.routing.router import PrefillTarget, RouterConfig, create_router_app
from kvabi.server.launch import ServerProcess, free_port
from tests.server.tiny_server import free_blocks

T = TypeVar("T")
SECRET = "disagg-test-secret-0123456789"
ENV = {"KVABI_KV_SECRET": SECRET}


def tiny_args(folder: str, dtype: str = "fp32") -> list[str]:
    """`kvabi serve` arguments for a tiny model's folder, 128 blocks, weights and KV in `dtype`."""
    return [
        "--model",
        folder,
        "--served-model-name",
        "tiny",
        "--dtype",
        dtype,
        "--num-blocks",
        "128",
    ]


class Instance:
    """One `kvabi serve` process of a role; a prefill instance also has its KV address."""

    def __init__(
        self, model_args: list[str], role: str, layout: str, block_size: int, *extra: str
    ) -> None:
        self.kv_address = f"127.0.0.1:{_port()}"
        args = [*model_args, "--kv-layout", layout, "--block-size", str(block_size)]
        args += ["--role", role]
        if role == "prefill":
            args += ["--kv-address", self.kv_address]
        self.process = ServerProcess(args + list(extra), startup_timeout_s=180, env=ENV)
        self.process.port = _port()

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def target(self) -> PrefillTarget:
        return PrefillTarget(self.url, self.kv_address)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its peers."""
        assert self.process.process is not None
        self.process.process.kill()
        self.process.process.wait()

    def free_blocks(self) -> tuple[float, float]:
        """(free, total) blocks of its pool, from /metrics."""
        return free_blocks(self.url)

    def settled_free_blocks(self, timeout_s: float = 5.0) -> tuple[float, float]:
        """`free_blocks` once every block is free, or as it is after `timeout_s` (a prefill
        releases a loan of its blocks a moment after the decode side READ them)."""
        deadline = time.monotonic() + timeout_s
        while (now := self.free_blocks())[0] != now[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        return now


_TAKEN: set[int] = set()


def _port() -> int:
    """A free port no other instance of this test run was given (the OS may repeat one)."""
    port = free_port()
    while port in _TAKEN:
        port = free_port()
    _TAKEN.add(port)
    return port


def start_all(instances: list[Instance]) -> None:
    """Start every process at once, then wait for each (they load in parallel)."""
    for i in instances:
        i.process.start()
    for i in instances:
        i.process.wait_ready()


def through_router(
    prefill: list[Instance], decode: list[Instance], fn: Callable[[httpx.AsyncClient], Awaitable[T]]
) -> T:
    """`fn(client)` against the router app in-process; it reaches the instances over HTTP."""
    app = create_router_app(
        RouterConfig(tuple(p.target for p in prefill), tuple(d.url for d in decode), timeout_s=60)
    )

    async def main() -> T:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await fn(client)

    return asyncio.run(main())


def colocated_then_routed(
    prefill: Instance, decode: Instance, chat: dict, timeout_s: float = 300
) -> tuple[dict, httpx.Response]:
    """Start both, ask the prefill instance (a whole engine) with the top-2 logprobs of each
    step, then the same through the router; stop both. Returns (colocated JSON, routed)."""
    try:
        start_all([prefill, decode])
        body = chat | {"logprobs": True, "top_logprobs": 2}
        url = f"{prefill.url}/v1/chat/completions"
        want = httpx.post(url, json=body, timeout=timeout_s).json()

        async def send(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post("/v1/chat/completions", json=chat)

        return want, through_router([prefill], [decode], send)
    finally:
        prefill.process.stop(), decode.process.stop()


def min_top2_margin(colocated: dict) -> float:
    """The smallest top-2 logprob margin over the colocated answer's steps."""
    top2 = [e["top_logprobs"] for e in colocated["choices"][0]["logprobs"]["content"]]
    return min(a["logprob"] - b["logprob"] for a, b in top2)
