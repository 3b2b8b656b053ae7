"""`kvabi bench disagg`: KV transfer throughput of the transports against a raw loopback
socket copy of the same bytes, then TTFT/ITL colocated vs disaggregated, in the same run.

1. Transfer: real fetches over 127.0.0.1 from a prefill-side process (kvabi/bench/
   transfer_peer.py) to this one: control message, the ABI container written layer by layer
   (each section checksummed by the sender and verified by the receiver), block hashes
   verified, tensors ready for placement; over TCP and, when nixl is installed, over NIXL. The
   baseline has the same process send the same container bytes (written once, held in memory)
   through a plain connected socket into a preallocated buffer here: what any transport pays
   for the copy. Each path's best of many fetches, taken in turn, so a noisy neighbour slows
   all of them alike.
2. Latency under a mixed load, real processes on the same cores (kvabi/bench/disagg_load.py).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvabi.abi.catalog import catalog_model
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.presets import preset_descriptor
from kvabi.abi.table import print_table
from kvabi.bench.report import machine, write_json
from kvabi.bench.transfer_peer import make_transport, token_ids
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.nixl_memory import is_nixl_available
from kvabi.transfer.transport import FetchRequest


def run(quick: bool, json_path: str | None, model_name: str = "smollm2-135m") -> dict:
    figures = transfer(model_name, 1024 if quick else 4096, 40 if quick else 60)
    from kvabi.bench.disagg_load import run_load  # TTFT/ITL under a mixed load, real processes

    figures |= run_load(quick)
    write_json(json_path, figures)
    return figures


def transfer(model_name: str, num_tokens: int, repeats: int) -> dict:
    """The transfer rows: `num_tokens` (x 23 KB/token in bf16 for SmolLM2) sent as HND blocks
    of 16 tokens to a decode side that keeps NHD blocks of 32. Each transport gets its own
    prefill-side process and its own baseline, interleaved with it and nothing else."""
    dst_desc = preset_descriptor("vllm-flash-attn", catalog_model(model_name), block_size=32)
    info, t = _fetch_times(model_name, num_tokens, "tcp", dst_desc, repeats, place=True)
    nbytes = info["num_bytes"]
    figures = {
        "bytes": nbytes,
        "num_tokens": info["num_tokens"],
        "raw_socket_gbps": nbytes / t["raw"] / 1e9,
        "tcp_transport_gbps": nbytes / t["fetch"] / 1e9,
        "tcp_vs_raw_socket_ratio": t["raw"] / t["fetch"],
        "fetch_and_place_gbps": nbytes / t["place"] / 1e9,
        "fetch_and_place_ratio": t["raw_place"] / t["place"],
        "nixl_transport_gbps": None,
        "nixl_vs_raw_socket_ratio": None,
    }  # nixl_rows.py adds the NIXL rows' figures when nixl is installed
    if is_nixl_available():
        from kvabi.bench.nixl_rows import nixl_figures

        figures |= nixl_figures(model_name, num_tokens, dst_desc, repeats, nbytes)
    figures["ran_on"] = _ran_on()
    _print(model_name, figures)
    return figures


def _ran_on() -> dict:
    """The machine and the transfer stack the rows ran on (figures from different machines
    are never to be compared)."""
    try:
        nixl = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        nixl = "not installed"
    return machine() | {
        "nixl": nixl,
        "ucx transports": os.environ.get("UCX_TLS", "UCX's own choice"),
    }


def _fetch_times(
    model_name: str,
    num_tokens: int,
    transport: str,
    dst_desc: Descriptor,
    repeats: int,
    place: bool = False,
) -> tuple[dict, dict[str, float]]:
    """The peer's info and best seconds of: its raw copy (`raw`) and a fetch over `transport`
    (`fetch`), interleaved; with `place`, also a fetch converted for placement (`place`) and
    the raw copy interleaved with it (`raw_place`)."""
    with prefill_peer(model_name, num_tokens, transport) as info:
        client = make_transport(transport).connect(info["address"], dst_desc)
        request = FetchRequest(token_ids(info["num_tokens"]))
        raw = raw_receiver(info["raw_port"], info["num_bytes"])
        try:
            raw_s, fetch_s = interleaved_best([raw, lambda: client.fetch(request)], repeats)
            times = {"raw": raw_s, "fetch": fetch_s}
            if place:
                fn = lambda: stage_payload(client.fetch(request), dst_desc)  # noqa: E731
                times["raw_place"], times["place"] = interleaved_best(
                    [raw, fn], max(3, repeats // 4)
                )
        finally:
            client.close()
    return info, times


@contextmanager
def prefill_peer(model_name: str, num_tokens: int, transport: str) -> Iterator[dict]:
    """A prefill-side process (transfer_peer.py) serving over `transport`; yields its
    addresses and stops it on exit."""
    args = [sys.executable, "-m", "kvabi.bench.transfer_peer", model_name, str(num_tokens)]
    with subprocess.Popen(
        [*args, transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as peer:
        assert peer.stdin is not None and peer.stdout is not None
        try:
            line = peer.stdout.readline()
            if not line:
                raise RuntimeError(f"the bench's {transport} prefill-side process did not start")
            yield json.loads(line)
        finally:
            peer.stdin.close()
            peer.wait(30)


def _print(model_name: str, f: dict) -> None:
    nixl_rows = [["kvabi nixl transport", "not installed", "", ""]]
    if f["nixl_transport_gbps"]:
        from kvabi.bench.nixl_rows import nixl_table_rows

        nixl_rows = nixl_table_rows(f)
    print_table(
        f"KV transfer, {model_name}, {f['num_tokens']} tokens, {f['bytes'] / 1e6:.1f} MB over "
        "127.0.0.1, prefill side in its own process",
        ["path", "GB/s", "vs raw socket", "vs raw NIXL READ"],
        [
            ["raw socket copy of the container (baseline)", f["raw_socket_gbps"], 1.0, ""],
            [
                "kvabi tcp transport (fetch)",
                f["tcp_transport_gbps"],
                f["tcp_vs_raw_socket_ratio"],
                "",
            ],
            [
                "tcp fetch + convert HND/16 -> NHD/32",
                f["fetch_and_place_gbps"],
                f["fetch_and_place_ratio"],
                "",
            ],
            *nixl_rows,
        ],
    )
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()))


def interleaved_best(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each function's fastest of `repeats` timed calls, taken in turn (a, b, c, a, b, c, ...)
    after one untimed round: a noisy neighbour then slows every path alike, not one of them."""
    best = [float("inf")] * len(fns)
    for round_ in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def raw_receiver(port: int, nbytes: int) -> Callable[[], None]:
    """One raw copy per call: ask the peer for the container bytes, receive them into a
    preallocated buffer (4 MiB reads, as the transport's)."""
    conn = socket.create_connection(("127.0.0.1", port))
    sink = bytearray(nbytes)

    def copy() -> None:
        conn.sendall(b"x")
        view, got = memoryview(sink), 0
        while got < nbytes:
            n = conn.recv_into(view[got:], min(nbytes - got, 4 * 2**20))
            if not n:
                raise ConnectionError("the bench's prefill-side process closed the raw socket")
            got += n

    return copy
