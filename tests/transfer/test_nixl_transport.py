"""The `nixl` transport (NIXL over UCX, DRAM to DRAM) between in-process and real-process
peers: the same payload as the TCP transport, and every refusal. Skipped without nixl."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from kvabi.cache.kv_cache import ImportResult
from kvabi.disagg.settings import DisaggSettings
from kvabi.transfer.errors import AuthError, PeerClosedError, TransferError, TransferTimeoutError
from kvabi.transfer.framing import recv_msg, send_msg
from kvabi.transfer.handshake import client_handshake
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.transfer.transport import FetchRequest, KVPayload, TransportConfig
from kvabi.wire.errors import ChecksumError
from tests.disagg.tiny_peers import SECRET, config, engine, greedy, prefill_provider
from tests.engine.tiny import greedy_reference
from tests.transfer.faults import faulty
from tests.transfer.nixl_peer import READY

pytestmark = pytest.mark.skipif(not is_nixl_available(), reason="nixl is not installed")
PROMPT = tuple(range(3, 24))  # 21 tokens: 5 blocks of 4 + 1
SLOT_BYTES = 4096  # the tiny model's container is ~12 KB: several windows, slots reused


def nixl(cfg: TransportConfig | None = None, faults: str = ""):
    """The NIXL transport; with a fault plan (tests/transfer/faults.py), a faulty one."""
    from kvabi.transfer.nixl_transport import NixlTransport

    transport = faulty(NixlTransport, faults) if faults else NixlTransport
    return transport(cfg or config(), slot_bytes=SLOT_BYTES, num_slots=4)


def nixl_server(cfg: TransportConfig | None = None, faults: str = ""):
    e = engine("nhd", 4)
    return nixl(cfg, faults).listen("127.0.0.1:0", e.info.descriptor, prefill_provider(e))


def tcp_payload(request: FetchRequest, decode_desc) -> KVPayload:
    from kvabi.transfer.tcp_transport import TcpTransport

    e = engine("nhd", 4)
    server = TcpTransport(config()).listen("127.0.0.1:0", e.info.descriptor, prefill_provider(e))
    client = TcpTransport(config()).connect(server.address, decode_desc)
    payload = client.fetch(request)
    client.close(), server.close()
    return payload


def assert_same_payload(a: KVPayload, b: KVPayload) -> None:
    assert (a.start_token, a.token_ids, a.block_hashes) == (
        b.start_token,
        b.token_ids,
        b.block_hashes,
    )
    assert a.cache.desc == b.cache.desc and sorted(a.cache.tensors) == sorted(b.cache.tensors)
    for key, tensor in b.cache.tensors.items():
        assert torch.equal(a.cache.tensors[key], tensor), key


@pytest.fixture(scope="module")
def server():
    s = nixl_server()
    yield s
    s.close()


def test_a_fetch_equals_the_tcp_transports_and_decodes_identically(server):
    decode = engine("hnd", 8)  # HND blocks of 8 receiving NHD blocks of 4
    client = nixl().connect(server.address, decode.info.descriptor)
    assert client.peer_desc.layout.block_size == 4
    for start in (0, 8, 0):  # twice whole (the windows' slots are reused), once a suffix
        request = FetchRequest(PROMPT, start)
        payload = client.fetch(request)
        assert (payload.start_token, payload.end_token) == (start, 20)
        assert_same_payload(payload, tcp_payload(request, decode.info.descriptor))
    staged = stage_payload(payload, decode.info.descriptor)
    assert decode.cache.import_blocks(PROMPT, None, staged) == ImportResult(16, 2)
    # the decode side computes only the prompt's tail: exact, as the margins are clear (tiny.py)
    want = greedy(engine("nhd", 4), list(PROMPT))
    assert greedy(decode, list(PROMPT)) == want == list(greedy_reference(PROMPT, len(want)))
    client.close()


def test_a_prompt_shorter_than_a_block_sends_an_empty_container(server):
    payload = nixl().connect(server.address, engine().info.descriptor).fetch(FetchRequest((5, 6)))
    assert (payload.start_token, payload.token_ids, payload.cache.extent) == (0, (), 0)


def test_a_wrong_secret_is_refused_and_learns_no_nixl_metadata(server):
    with pytest.raises(AuthError):
        nixl(TransportConfig(b"another-secret-of-16+")).connect(
            server.address, engine().info.descriptor
        )
    host, port = server.address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with pytest.raises(AuthError):
            client_handshake(raw, b"another-secret-of-16+", engine().info.descriptor)
        with pytest.raises((PeerClosedError, TransferError)):  # hung up: no "nixl_md" for us
            send_msg(raw, {"t": "nixl_hello"})
            recv_msg(raw)
    fetched = nixl().connect(server.address, engine().info.descriptor).fetch(FetchRequest(PROMPT))
    assert fetched.end_token == 20  # still serving


def test_a_corrupt_region_fails_its_checksum_and_places_nothing():
    server = nixl_server(faults="corrupt,none")
    decode = engine("hnd", 8)
    client = nixl().connect(server.address, decode.info.descriptor)
    with pytest.raises(ChecksumError, match="layer 0 is corrupt"):
        client.fetch(FetchRequest(PROMPT))
    assert (decode.cache.pool.num_free, decode.cache.pool.num_cached) == (64, 0)
    assert client.fetch(FetchRequest(PROMPT)).end_token == 20  # a fresh connection, intact
    client.close(), server.close()


def test_a_stalled_transfer_times_out():
    server = nixl_server(faults="stall:3")
    client = nixl(config(io_timeout_s=0.5)).connect(server.address, engine().info.descriptor)
    began = time.monotonic()
    with pytest.raises(TransferTimeoutError):
        client.fetch(FetchRequest(PROMPT))
    assert time.monotonic() - began < 2.5
    client.close(), server.close()


def test_settings_select_nixl():
    settings = DisaggSettings("decode", SECRET, peers=("127.0.0.1:9000",), transport="nixl")
    assert settings.make_transport().name == "nixl"


class PeerProcess:
    def __init__(self, fault: str = "") -> None:
        command = [sys.executable, "-m", "tests.transfer.nixl_peer", fault]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = ""
        while not line.startswith(READY):  # a few seconds: the peer imports torch and nixl
            line = self.process.stdout.readline()
            assert line, "the nixl peer exited before serving"
        self.address = line[len(READY) :].strip()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture
def peers():
    started: list[PeerProcess] = []
    yield lambda fault="": started.append(PeerProcess(fault)) or started[-1]
    for peer in started:
        peer.stop()


def test_two_processes_fetch_stall_and_die(peers):
    decode = engine("hnd", 8)
    peer = peers()
    client = nixl().connect(peer.address, decode.info.descriptor)
    payload = client.fetch(FetchRequest(PROMPT))
    assert_same_payload(payload, tcp_payload(FetchRequest(PROMPT), decode.info.descriptor))
    peer.stop()  # killed: the pooled connection is dead and no new one can be made
    with pytest.raises(TransferError, match="cannot reach prefill peer"):
        client.fetch(FetchRequest(PROMPT))
    frozen = peers("freeze")  # stops itself (SIGSTOP) after publishing the first window
    client = nixl(config(io_timeout_s=1.0)).connect(frozen.address, decode.info.descriptor)
    began = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="stalled past"):
        client.fetch(FetchRequest(PROMPT))  # here: the READ itself (UCX over TCP needs the peer)
    assert time.monotonic() - began < 5
    os.kill(frozen.process.pid, signal.SIGCONT)


@pytest.mark.parametrize("prefill_blocks", [("hnd", 4), ("nhd", 8)], ids=["convert", "same"])
def test_kvabi_serve_over_nixl_decodes_like_colocated(tmp_path, prefill_blocks):
    """Into a decode pool of NHD blocks of 8, READ out of the prefill's pool: HND blocks of 4
    through staging buffers, converted part by part; NHD blocks of 8 straight into the pool."""
    from tests.disagg.processes import Instance, start_all, through_router, tiny_args
    from tests.server.tiny_server import tiny_folder

    folder = str(tiny_folder(tmp_path))
    prefill = Instance(tiny_args(folder), "prefill", *prefill_blocks, "--kv-transport", "nixl")
    decode = Instance(
        tiny_args(folder), "decode", "nhd", 8, "--kv-peer", prefill.kv_address,
        "--kv-transport", "nixl",
    )  # fmt: skip
    start_all([prefill, decode])
    try:
        body = {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": "the quick brown fox jumps over the lazy dog"}
            ],
            "max_tokens": 12,
            "temperature": 0,
        }
        want = httpx.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=30)

        async def send(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post("/v1/chat/completions", json=body)

        got = through_router([prefill], [decode], send)
        assert got.status_code == 200, got.text
        content = got.json()["choices"][0]["message"]["content"]
        assert content and content == want.json()["choices"][0]["message"]["content"]
        num_prompt = got.json()["usage"]["prompt_tokens"]
        assert got.headers["x-kvabi-kv"] == f"prefill;tokens={num_prompt // 8 * 8};via=pool-read"
        assert decode.free_blocks() == (128, 128)
        assert prefill.settled_free_blocks() == (128, 128)
    finally:
        prefill.process.stop(), decode.process.stop()


IDLE_CPU = """
import resource, time
from kvabi.transfer.nixl_memory import make_agent
agent = make_agent("idle")
before = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(1.0)
after = resource.getrusage(resource.RUSAGE_SELF)
print((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
"""


def test_an_idle_agent_does_not_spin() -> None:
    """nixl's wrapper would run the progress thread without a pause: an idle decode or prefill
    instance would then burn a whole core (1 CPU-s per second). Ours sleeps between passes.
    Measured in a fresh process, so no other test's threads count."""
    out = subprocess.run([sys.executable, "-c", IDLE_CPU], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    used = float(out.stdout.split()[-1])
    assert used < 0.4, f"{used:.2f} CPU-s in 1 s idle: the progress thread spins"
