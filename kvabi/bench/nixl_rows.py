"""`kvabi bench disagg`'s NIXL rows, against two baselines measured in the same run: the raw
socket copy of the container (as for TCP) and a raw NIXL READ of the container's bytes, one
descriptor between the same two processes (what NIXL itself moves here).

Rows: the container through the arena's windows (`fetch`), the same converted for placement
into NHD blocks of 32 (`place`), the blocks READ straight from the peer's pool into blocks
reserved in a pool of the same descriptor (`pool_read`: reserve, READ, verify the checksums,
free them again, as a decode instance does before it indexes them), and the same into a pool
of NHD blocks of 32 (`pool_read_convert`: READ into staging buffers, each part converted into
the reserved blocks while the next is READ). Every row is interleaved with both baselines.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvabi.abi.catalog import catalog_model
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.presets import preset_descriptor
from kvabi.bench.disagg_bench import interleaved_best, prefill_peer, raw_receiver
from kvabi.bench.transfer_peer import SRC_PRESET, make_transport, token_ids
from kvabi.cache.kv_cache import KVCache
from kvabi.transfer.kv_staging import stage_payload
from kvabi.transfer.nixl_read import nixl_read
from kvabi.transfer.transport import FetchRequest, KVClient


def nixl_figures(
    model_name: str, num_tokens: int, dst_desc: Descriptor, repeats: int, nbytes: int
) -> dict:
    """The NIXL rows' figures: GB/s of the container's bytes, and `*_ratio`s."""
    t = _times(model_name, num_tokens, dst_desc, repeats)
    figures = {
        "raw_nixl_read_gbps": nbytes / t["raw_nixl"] / 1e9,
        "nixl_transport_gbps": nbytes / t["fetch"] / 1e9,
        "nixl_vs_raw_socket_ratio": t["raw"] / t["fetch"],
        "nixl_vs_raw_nixl_ratio": t["raw_nixl"] / t["fetch"],
        "raw_nixl_vs_raw_socket_ratio": t["raw"] / t["raw_nixl"],
        "nixl_fetch_and_place_gbps": nbytes / t["place"] / 1e9,
        "nixl_fetch_and_place_ratio": t["raw"] / t["place"],
        "nixl_fetch_and_place_vs_raw_nixl_ratio": t["raw_nixl"] / t["place"],
        "nixl_pool_read_gbps": nbytes / t["pool_read"] / 1e9,
        "nixl_pool_read_vs_raw_socket_ratio": t["raw"] / t["pool_read"],
        "nixl_pool_read_vs_raw_nixl_ratio": t["raw_nixl"] / t["pool_read"],
        "nixl_pool_read_convert_gbps": nbytes / t["pool_read_convert"] / 1e9,
        "nixl_pool_read_convert_vs_raw_socket_ratio": t["raw"] / t["pool_read_convert"],
        "nixl_pool_read_convert_vs_raw_nixl_ratio": t["raw_nixl"] / t["pool_read_convert"],
    }
    return figures


def nixl_table_rows(f: dict) -> list[list]:
    raw_nixl = f["raw_nixl_read_gbps"]
    return [
        [
            "raw NIXL READ of the container (baseline)",
            raw_nixl,
            f["raw_nixl_vs_raw_socket_ratio"],
            1.0,
        ],
        [
            "kvabi nixl transport (fetch)",
            f["nixl_transport_gbps"],
            f["nixl_vs_raw_socket_ratio"],
            f["nixl_vs_raw_nixl_ratio"],
        ],
        [
            "nixl fetch + convert HND/16 -> NHD/32",
            f["nixl_fetch_and_place_gbps"],
            f["nixl_fetch_and_place_ratio"],
            f["nixl_fetch_and_place_vs_raw_nixl_ratio"],
        ],
        [
            "nixl pool to pool (READ into reserved blocks)",
            f["nixl_pool_read_gbps"],
            f["nixl_pool_read_vs_raw_socket_ratio"],
            f["nixl_pool_read_vs_raw_nixl_ratio"],
        ],
        [
            "nixl pool to pool + convert HND/16 -> NHD/32",
            f["nixl_pool_read_convert_gbps"],
            f["nixl_pool_read_convert_vs_raw_socket_ratio"],
            f["nixl_pool_read_convert_vs_raw_nixl_ratio"],
        ],
    ]


def _times(model_name: str, num_tokens: int, dst_desc: Descriptor, repeats: int) -> dict:
    with prefill_peer(model_name, num_tokens, "nixl") as info:
        client = make_transport("nixl").connect(info["address"], dst_desc)
        same = make_transport("nixl").connect(info["address"], _src_desc(model_name))
        request = FetchRequest(token_ids(info["num_tokens"]))
        raw = raw_receiver(info["raw_port"], info["num_bytes"])
        try:
            fns = {
                "raw": raw,
                "raw_nixl": _raw_read(client, info),
                "fetch": lambda: client.fetch(request),
                "place": lambda: stage_payload(client.fetch(request), dst_desc),
                "pool_read": _pool_read(same, info, same.peer_desc),
                "pool_read_convert": _pool_read(client, info, dst_desc),
            }  # every row interleaved with both baselines
            return dict(zip(fns, interleaved_best(list(fns.values()), repeats), strict=True))
        finally:
            client.close(), same.close()


def _src_desc(model_name: str) -> Descriptor:
    return preset_descriptor(SRC_PRESET, catalog_model(model_name))


def _raw_read(client: KVClient, info: dict) -> Callable[[], None]:
    """One NIXL READ of the peer's registered copy of the container into a registered buffer
    of ours, by the client's agent (which loaded the peer's metadata)."""
    agent, nbytes = client.agent, info["num_bytes"]
    local = torch.zeros(nbytes, dtype=torch.uint8)  # [num_bytes], touched
    agent.register_memory([(local.data_ptr(), nbytes, 0, "")], "DRAM")
    peer, remote = info["raw_nixl_agent"], info["raw_nixl_addr"]
    return lambda: nixl_read(agent, peer, local.data_ptr(), remote, nbytes, 10.0)


def _pool_read(client: KVClient, info: dict, desc: Descriptor) -> Callable[[], None]:
    """A fetch that READs the peer's lent blocks into a pool of `desc` (not the peer's:
    through staging buffers, converted part by part)."""
    num_blocks = info["num_tokens"] // desc.layout.block_size
    cache = KVCache(desc, 2 * num_blocks)
    ids = token_ids(info["num_tokens"])
    request = FetchRequest(ids)

    def read() -> None:
        reservation = cache.reserve(ids, None, 0, num_blocks)
        try:
            assert client.fetch_into(request, reservation).num_blocks == num_blocks
        finally:
            cache.cancel(reservation)

    return read
