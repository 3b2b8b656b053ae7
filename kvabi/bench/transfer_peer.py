"""The prefill side of `kvabi bench disagg`'s transfer rows, as its own process (as in a real
deployment: prefill and decode never share an interpreter, so neither waits on the other's GIL).

`python -m kvabi.bench.transfer_peer MODEL NUM_TOKENS tcp|nixl` builds a payload of random KV
in the `vllm-flash-attn-hnd` layout (seeded: the same bytes every run), serves it on 127.0.0.1
over that transport, and opens a raw socket that sends the payload's container bytes (held in
memory, written once) for each byte it receives: the baseline. One transport per process: a
NIXL agent's UCX threads would otherwise slow the TCP rows and the baseline. It prints one JSON
line with the addresses, then serves until stdin closes.
"""

from __future__ import annotations

import json
import socket
import sys
import threading

import torch

from kvabi.abi.buffers import CacheBuffers, allocate
from kvabi.abi.catalog import catalog_model
from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_hasher import BlockHasher
from kvabi.transfer.tcp_transport import TcpTransport
from kvabi.transfer.transport import KVLoan, KVPayload, KVServer, Transport, TransportConfig
from kvabi.wire.container_writer import container_bytes

SECRET = b"kvabi-bench-disagg-secret"
SRC_PRESET = "vllm-flash-attn-hnd"


def token_ids(num_tokens: int) -> tuple[int, ...]:
    """The bench prompt's tokens (both processes derive them; only whole blocks are sent)."""
    return tuple(i % 1000 for i in range(num_tokens))


def payload(desc: Descriptor, num_tokens: int) -> KVPayload:
    bs = desc.layout.block_size
    num_tokens -= num_tokens % bs
    gen = torch.Generator().manual_seed(0)
    tensors = {
        k: torch.randn(v.shape, generator=gen).to(v.dtype)
        for k, v in allocate(desc, num_tokens // bs).items()
    }
    ids = token_ids(num_tokens)
    hashes = BlockHasher(desc.model.compat_digest(), bs).hashes(ids)
    return KVPayload(0, ids, tuple(hashes), CacheBuffers(desc, tensors))


def main(model_name: str, num_tokens: int, transport: str) -> None:
    desc = preset_descriptor(SRC_PRESET, catalog_model(model_name))
    kv = payload(desc, num_tokens)
    loan = lent(kv)
    provide = lambda r: loan if r.reads_blocks else kv  # noqa: E731
    server = make_transport(transport).listen("127.0.0.1:0", desc, provide, loan.buffers)
    blob = container_bytes(kv.cache, kv.token_ids, kv.block_hashes)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_send_on_request, args=(raw, blob), daemon=True).start()
    addresses = {
        "address": server.address,
        "raw_port": raw.getsockname()[1],
        "num_bytes": len(blob),
        "num_tokens": len(kv.token_ids),
    }
    if transport == "nixl":  # a registered copy of the container, for a raw NIXL READ of it
        addresses |= _raw_nixl(server, blob)
    print(json.dumps(addresses), flush=True)
    sys.stdin.read()  # the bench closes stdin (or exits) when done
    server.close()


def lent(kv: KVPayload) -> KVLoan:
    """`kv`'s blocks as a pool's loan: a pool of twice as many blocks, holding them in its
    second half (a fetch that reads blocks READs them from there; nothing is pinned)."""
    n = kv.cache.extent
    pool = CacheBuffers.empty(kv.cache.desc, 2 * n, "zeros")
    ids = tuple(range(n, 2 * n))
    convert(kv.cache, kv.cache.desc, num_tokens=len(kv.token_ids), dst_block_ids=ids, out=pool)
    return KVLoan(0, kv.token_ids, kv.block_hashes, pool, ids, lambda: None)


def _raw_nixl(server: KVServer, blob: bytes) -> dict:
    """The container's bytes registered with the server's agent (before any peer loads its
    metadata), and where they lie."""
    memory = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # [num_bytes]
    server.agent.register_memory([(memory.data_ptr(), memory.numel(), 0, "")], "DRAM")
    _KEEP.append(memory)
    return {"raw_nixl_addr": memory.data_ptr(), "raw_nixl_agent": server.agent.name}


_KEEP: list[torch.Tensor] = []  # registered memory lives as long as the process


def make_transport(name: str) -> Transport:
    config = TransportConfig(SECRET)
    if name == "nixl":
        from kvabi.transfer.nixl_transport import NixlTransport

        return NixlTransport(config)
    return TcpTransport(config)


def _send_on_request(listener: socket.socket, blob: bytes) -> None:
    conn, _ = listener.accept()
    while conn.recv(1):
        conn.sendall(blob)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
