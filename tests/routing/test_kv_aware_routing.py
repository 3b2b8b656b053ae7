"""Prefix-aware routing with real processes: instances publish their block events (ZMQ, vLLM's
format), a real `kvabi router` process follows them, and a repeat of a long prompt goes to the
instance that cached it, colocated and disaggregated."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from kvabi.server.launch import free_port
from tests.disagg.processes import Instance, start_all, tiny_args
from tests.server.tiny_server import tiny_folder

STORY = "the quick brown fox jumps over the lazy dog while the cat naps in the sun; " * 4


def chat(content: str) -> dict:
    messages = [{"role": "user", "content": content}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}


def publishing(model: list[str], role: str, layout: str, bs: int, *extra: str) -> Instance:
    instance = Instance(model, role, layout, bs, *extra)
    instance.events = f"tcp://127.0.0.1:{free_port()}"
    instance.process.args += ["--kv-events", instance.events]
    return instance


class RouterProcess:
    """`kvabi router ARGS` on a free port."""

    def __init__(self, args: list[str]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "kvabi.cli.main", "router", "--port", str(port)]
        self.process = subprocess.Popen(
            command + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )

    def health(self, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stdout.read().decode()
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the router never became healthy")

    def wait_blocks(self, url: str, n: int, timeout_s: float = 20) -> dict[str, int]:
        """Until the router's index holds at least `n` blocks of instance `url`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            blocks = self.health()["kv_blocks"]
            if blocks.get(url, 0) >= n:
                return blocks
            time.sleep(0.1)
        raise TimeoutError(f"the router's index never got {n} blocks of {url}: {blocks}")

    def post(self, body: dict) -> httpx.Response:
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def events_args(instances: list[Instance]) -> list[str]:
    return [x for i in instances for x in ("--kv-events", i.url, i.events)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = tiny_args(str(tiny_folder(tmp_path_factory.mktemp("tiny"))))
    a = publishing(model, "both", "nhd", 4)
    b = publishing(model, "both", "nhd", 4)
    prefill = publishing(model, "prefill", "hnd", 4)
    peer = ("--kv-peer", prefill.kv_address)
    d0 = publishing(model, "decode", "nhd", 8, *peer)
    d1 = publishing(model, "decode", "nhd", 8, *peer)
    fleet = {"a": a, "b": b, "prefill": prefill, "d0": d0, "d1": d1}
    start_all(list(fleet.values()))
    yield fleet
    for i in fleet.values():
        i.process.stop()


def test_colocated_repeat_goes_to_the_instance_that_cached_it(fleet):
    a, b = fleet["a"], fleet["b"]
    router = RouterProcess(["--decode", a.url, "--decode", b.url, *events_args([a, b])])
    try:
        assert router.health()["kv_blocks"] == {}
        first = router.post(chat(STORY))
        owner = first.headers["x-kvabi-instance"]
        other = b.url if owner == a.url else a.url
        assert first.headers["x-kvabi-cached-tokens"] == "0"
        num_prompt = first.json()["usage"]["prompt_tokens"]
        blocks = router.wait_blocks(owner, num_prompt // 4)
        assert blocks.get(other, 0) == 0
        for _ in range(2):  # round robin alone would send one of these to the other instance
            again = router.post(chat(STORY))
            assert again.headers["x-kvabi-instance"] == owner
            assert again.headers["x-kvabi-cached-tokens"] == str(num_prompt // 4 * 4)
            assert again.json()["choices"] == first.json()["choices"]
        # another prompt shares only the template's "<|user|>" (8 byte tokens, 2 blocks)
        fresh = router.post(chat("a different prompt " * 8))
        assert fresh.headers["x-kvabi-cached-tokens"] == "8"
        assert fresh.headers["x-kvabi-instance"] == owner
    finally:
        router.stop()


def test_disaggregated_repeat_goes_to_the_decode_instance_that_holds_it(fleet):
    prefill, d0, d1 = fleet["prefill"], fleet["d0"], fleet["d1"]
    args = ["--prefill", prefill.url, prefill.kv_address, "--decode", d0.url, "--decode", d1.url]
    router = RouterProcess(args + events_args([prefill, d0, d1]))
    try:
        router.health()
        body = chat("disaggregated: " + STORY)
        first = router.post(body)
        owner = first.headers["x-kvabi-instance"]
        assert owner in (d0.url, d1.url)
        num_prompt = first.json()["usage"]["prompt_tokens"]
        router.wait_blocks(prefill.url, num_prompt // 4)  # every role publishes
        router.wait_blocks(owner, num_prompt // 8)
        for _ in range(2):
            again = router.post(body)
            assert again.headers["x-kvabi-instance"] == owner
            assert again.headers["x-kvabi-cached-tokens"] == str(num_prompt // 8 * 8)
            assert again.json()["choices"] == first.json()["choices"]
    finally:
        router.stop()
