"""The `nixl` transport's row of `kvabi bench disagg`: the fetch time of the same payload.

Same measurement as the TCP row: a real fetch over 127.0.0.1 (authenticated control
connection, the container staged in registered slots, READ window by window through NIXL/UCX,
every section checksum verified, block hashes checked), prefill side and decode side in this
process, the provider returning a ready payload. None when nixl is not installed.
"""

from __future__ import annotations

from kvabi.abi.descriptor import Descriptor
from kvabi.bench.report import best_seconds
from kvabi.disagg.nixl_memory import is_nixl_available
from kvabi.disagg.transport import FetchRequest, KVPayload, TransportConfig

SECRET = b"kvabi-bench-disagg-secret"


def nixl_fetch_seconds(payload: KVPayload, dst_desc: Descriptor, repeats: int) -> float | None:
    """Best of `repeats` fetches of `payload` (after one warm-up) by a `dst_desc` decode side
    over the nixl transport; None without nixl."""
    if not is_nixl_available():
        return None
    from kvabi.disagg.nixl_transport import NixlTransport

    transport = NixlTransport(TransportConfig(SECRET))
    server = transport.listen("127.0.0.1:0", payload.cache.desc, lambda _: payload)
    client = transport.connect(server.address, dst_desc)
    request = FetchRequest(payload.token_ids)
    try:
        return best_seconds(lambda: client.fetch(request), repeats)
    finally:
        client.close()
        server.close()
