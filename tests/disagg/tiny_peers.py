"""In-process prefill and decode peers over loopback sockets, with the tiny model."""

from __future__ import annotations

import threading
from dataclasses import replace

from kvabi.engine.engine import EngineConfig, LLMEngine
from kvabi.engine.outputs import OutputAccumulator
from kvabi.engine.sampling_params import SamplingParams
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import FetchRequest, KVLoan, KVPayload, KVServer, TransportConfig
from tests.engine.tiny import tiny_loaded

SECRET = b"0123456789abcdef-test-secret"


def config(**changes: object) -> TransportConfig:
    return TransportConfig(SECRET, **{"io_timeout_s": 5.0, "transfer_timeout_s": 10.0, **changes})


def engine(layout: str = "nhd", block_size: int = 4, fingerprint: str = "tiny") -> LLMEngine:
    config = EngineConfig(kv_layout=layout, block_size=block_size, num_blocks=64)
    return LLMEngine(tiny_loaded(), config, fingerprint=fingerprint)


def prefill_provider(e: LLMEngine):
    """Prefill (max_tokens=1) on `e`, then export its blocks, or lend them to a fetch that
    reads blocks; one request at a time (a loan is released under the same lock)."""
    lock = threading.Lock()

    def release(loan: KVLoan) -> None:
        with lock:
            loan.release()

    def provide(request: FetchRequest) -> KVPayload | KVLoan:
        ids, salt, start = request.token_ids, request.cache_salt, request.start_token
        with lock:
            e.add_request(list(ids), SamplingParams(max_tokens=1))
            while e.has_unfinished():
                e.step()
            if request.reads_blocks:
                loan = e.cache.lend(ids, salt, start)
                return replace(loan, release=lambda: release(loan))
            return e.cache.export(ids, salt, start)

    return provide


def prefill_server(
    e: LLMEngine, cfg: TransportConfig | None = None, transport: type = TcpTransport
) -> KVServer:
    """`e` as a prefill instance on `transport` (tests/transfer/faults.py has faulty ones)."""
    transport = transport(cfg or config())
    return transport.listen("127.0.0.1:0", e.info.descriptor, prefill_provider(e))


def greedy(e: LLMEngine, ids: list[int], n: int = 12) -> list[int]:
    request_id = e.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    outputs = OutputAccumulator()
    while e.has_unfinished():
        for out in outputs.add(e.step()):
            if out.request_id == request_id:
                return list(out.outputs[0].token_ids)
    raise AssertionError("the request never finished")
