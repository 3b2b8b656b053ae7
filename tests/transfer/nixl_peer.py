"""A prefill peer in its own process: the tiny engine served over the `nixl` transport.

`python -m tests.transfer.nixl_peer` prints `serving KV on HOST:PORT` and serves until its
stdin closes. Faults come from KVABI_DISAGG_FAULT, as for the server in-process.
"""

from __future__ import annotations

import sys

from kvabi.transfer.nixl_transport import NixlTransport
from tests.disagg.tiny_peers import config, engine, prefill_provider

READY = "serving KV on "
SLOT_BYTES = 4096  # several windows per transfer even for the tiny model


def main() -> None:
    prefill = engine("nhd", 4)
    transport = NixlTransport(config(), slot_bytes=SLOT_BYTES, num_slots=4)
    server = transport.listen("127.0.0.1:0", prefill.info.descriptor, prefill_provider(prefill))
    print(READY + server.address, flush=True)
    sys.stdin.read()  # the test closes stdin (or kills us)
    server.close()


if __name__ == "__main__":
    main()
