"""Moving a prompt's KV between instances: the transport seam (`transport.py`), TCP and NIXL
transports, the handshake, framing, the KV endpoint's listener, and the staging of what
arrives (docs/ARCHITECTURE.md)."""
