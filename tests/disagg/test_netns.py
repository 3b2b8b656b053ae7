"""Prefill and decode in separate network namespaces joined by a veth pair (real processes).

The prefill instance runs in a namespace of its own (`ip netns exec`), reachable only over the
veth pair (10.213.0.1 there, 10.213.0.2 here); the decode instance stays in the test's
namespace and fetches the prompt's KV across the pair. Greedy output must equal the prefill
instance serving the request colocated. Needs root (CAP_NET_ADMIN) and iproute2: skipped where
a namespace cannot be made. With `tc netem` (the kernel's sch_netem), the pair also gets 20 ms
of delay and 2% loss each way; kernels without it (this machine's: "Specified qdisc kind is
unknown") run the test without, and `test_netem_delay_and_loss` is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvabi.server.launch import ServerProcess
from tests.disagg.processes import ENV, Instance, tiny_args
from tests.server.tiny_server import tiny_folder

PREFILL_IP, DECODE_IP = "10.213.0.1", "10.213.0.2"
KV_PORT = 8101  # the namespace has its own ports
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}],
    "max_tokens": 12,
    "temperature": 0,
}


@dataclass
class Pair:
    namespace: str
    has_netem: bool


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (ip netns)")
    ns, here, there = (
        f"kvabi-{os.getpid()}",
        f"kv{os.getpid() % 10**6}h",
        f"kv{os.getpid() % 10**6}t",
    )
    if _ip("netns", "add", ns).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        for args in (
            ["link", "add", here, "type", "veth", "peer", "name", there],
            ["link", "set", there, "netns", ns],
            ["addr", "add", f"{DECODE_IP}/30", "dev", here],
            ["link", "set", here, "up"],
            ["-n", ns, "addr", "add", f"{PREFILL_IP}/30", "dev", there],
            ["-n", ns, "link", "set", there, "up"],
            ["-n", ns, "link", "set", "lo", "up"],
        ):
            done = _ip(*args)
            assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"
        yield Pair(ns, _netem(ns, here, there))
    finally:
        _ip("link", "del", here)  # takes its peer with it
        _ip("netns", "del", ns)


def _netem(ns: str, here: str, there: str) -> bool:
    """Delay and loss on both ends of the pair, where the kernel has netem."""
    rule = ["root", "netem", "delay", "20ms", "loss", "2%"]
    done = subprocess.run(["tc", "qdisc", "add", "dev", here, *rule], capture_output=True)
    if done.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", there, *rule])
    return True


@pytest.fixture(scope="module")
def fleet(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    folder = str(tiny_folder(tmp_path_factory.mktemp("tiny")))
    args = [*tiny_args(folder), "--kv-layout", "hnd", "--block-size", "4", "--role", "prefill"]
    args += ["--kv-address", f"{PREFILL_IP}:{KV_PORT}"]
    netns = ["ip", "netns", "exec", pair.namespace]
    prefill = ServerProcess(args, 180, ENV, host=PREFILL_IP, prefix=netns)
    peer = ["--kv-peer", f"{PREFILL_IP}:{KV_PORT}", "--kv-timeout", "30"]
    decode = Instance(tiny_args(folder), "decode", "nhd", 8, *peer)
    with prefill:
        decode.process.start()
        decode.process.wait_ready()
        try:
            yield {"prefill": prefill, "decode": decode}
        finally:
            decode.process.stop()


def _chat(url: str, body: dict) -> httpx.Response:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response


def test_the_prefill_instance_is_only_reachable_across_the_pair(fleet: dict) -> None:
    assert fleet["prefill"].url == f"http://{PREFILL_IP}:{fleet['prefill'].port}"
    with pytest.raises(httpx.ConnectError):  # not on this namespace's loopback
        httpx.get(f"http://127.0.0.1:{fleet['prefill'].port}/health", timeout=2)


def test_kv_crosses_the_namespaces_and_greedy_output_is_colocated(fleet: dict) -> None:
    want = _chat(fleet["prefill"].url, CHAT).json()["choices"][0]["message"]["content"]
    got = _chat(fleet["decode"].url, CHAT)
    assert got.headers["x-kvabi-kv"].startswith("prefill;tokens=")  # fetched, not recomputed
    assert int(got.headers["x-kvabi-kv"].split("tokens=")[1].split(";")[0]) > 0
    assert got.json()["choices"][0]["message"]["content"] == want


def test_netem_delay_and_loss(pair: Pair, fleet: dict) -> None:
    if not pair.has_netem:
        pytest.skip("the kernel has no netem qdisc (tc: Specified qdisc kind is unknown)")
    body = CHAT | {"messages": [{"role": "user", "content": "over a slow and lossy link"}]}
    want = _chat(fleet["prefill"].url, body).json()["choices"][0]["message"]["content"]
    got = _chat(fleet["decode"].url, body)
    assert got.headers["x-kvabi-kv"].startswith("prefill;tokens=")
    assert got.json()["choices"][0]["message"]["content"] == want
