"""Routing requests to instances: the router, its prefix index fed by the instances' KV
events, and the KV-event wire format (docs/ARCHITECTURE.md)."""
