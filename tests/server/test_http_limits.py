"""Slow or vanishing HTTP clients against a real `kvabi serve`: headers and bodies have
deadlines, a disconnect is one log line, and everyone else is served meanwhile."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from kvabi.server.launch import ServerProcess
from tests.server.tiny_server import MODEL, tiny_folder

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tiny_folder(tmp_path_factory.mktemp("tiny"))
    args = ["--model", str(folder), "--served-model-name", MODEL, "--dtype", "fp32"]
    args += ["--num-blocks", "64", "--header-timeout", "1", "--body-timeout", "1"]
    with ServerProcess(args, startup_timeout_s=120) as s:
        yield s


def _raw(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass  # an error response, then the close
        return True
    except (TimeoutError, ConnectionResetError):
        return False


def test_400_clients_trickling_headers_are_dropped_and_others_are_served(server):
    socks = [_raw(server) for _ in range(400)]  # before: held for as long as they liked
    stop = threading.Event()

    def trickle():
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        while not stop.wait(0.3):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.sendall(b"X")

    dripper = threading.Thread(target=trickle, daemon=True)
    dripper.start()
    try:
        served = httpx.post(f"{server.base_url}/completions", json=GOOD, timeout=30)
        assert served.status_code == 200
        time.sleep(2.0)
        assert sum(_closed_by_server(s, 0.5) for s in socks) == 400
    finally:
        stop.set()
        dripper.join()
        for s in socks:
            s.close()


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    with _raw(server) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n" + b'{"prompt": "'
        )
        s.settimeout(5)
        start, reply = time.monotonic(), b""
        while chunk := s.recv(4096):  # the server closes after its answer
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert time.monotonic() - start < 3


def test_a_client_that_disconnects_mid_body_costs_one_log_line(server):
    before = server.output(tail_chars=10**7)
    for _ in range(5):
        with _raw(server) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")
            time.sleep(0.1)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    new = server.output(tail_chars=10**7)[len(before) :]
    assert "Traceback" not in new and "ClientDisconnect" not in new
    assert new.count("disconnected before its request was read") == 5, new
    assert len(new.strip().splitlines()) <= 10  # one line per disconnect, one per /health
