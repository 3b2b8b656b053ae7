"""A prefill peer in its own process: the tiny engine served over the `nixl` transport.

`python -m tests.transfer.nixl_peer [PLAN]` prints `serving KV on HOST:PORT` and serves until
its stdin closes; with a fault plan (tests/transfer/faults.py), over a faulty transport.
"""

from __future__ import annotations

import sys

from kvabi.transfer.nixl_transport import NixlTransport
from tests.disagg.tiny_peers import config, engine, prefill_provider
from tests.transfer.faults import faulty

READY = "serving KV on "
SLOT_BYTES = 4096  # several windows per transfer even for the tiny model


def main(plan: str) -> None:
    prefill = engine("nhd", 4)
    kind = faulty(NixlTransport, plan) if plan else NixlTransport
    transport = kind(config(), slot_bytes=SLOT_BYTES, num_slots=4)
    server = transport.listen("127.0.0.1:0", prefill.info.descriptor, prefill_provider(prefill))
    print(READY + server.address, flush=True)
    sys.stdin.read()  # the test closes stdin (or kills us)
    server.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
