"""Prefill/decode disaggregation: transports for a prompt's KV, its export and injection, roles
and the router (docs/ARCHITECTURE.md)."""
