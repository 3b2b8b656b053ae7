"""`kvabi disagg`: one command starts a router, a prefill and a decode instance; a request goes
through all three; stopping it stops them all."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from kvabi.server.launch import free_port
from tests.disagg.processes import ENV
from tests.server.tiny_server import tiny_folder


def wait_health(url: str, process: subprocess.Popen, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("kvabi disagg never became healthy")


def test_one_command_serves_through_prefill_and_decode(tmp_path):
    folder = str(tiny_folder(tmp_path / "tiny"))
    port = free_port()
    args = ["disagg", "--model", folder, "--dtype", "fp32", "--port", str(port)]
    args += ["--prefill-block-size", "4", "--decode-block-size", "8"]
    env = {**ENV, "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvabi.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        instances = wait_health(url, process)["instances"]
        assert list(instances.values()) == [200, 200]  # decode, then prefill
        body = {"messages": [{"role": "user", "content": "one command"}], "max_tokens": 5}
        r = httpx.post(f"{url}/v1/chat/completions", json=body | {"temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvabi-kv"].startswith("prefill;tokens=")
        assert r.headers["x-kvabi-instance"] == list(instances)[0]
    finally:
        process.terminate()
        process.wait(30)
    for instance in instances:  # the instances went with it
        try:
            httpx.get(f"{instance}/health", timeout=2)
            raise AssertionError(f"{instance} still answers")
        except httpx.TransportError:
            pass
