"""Prefill/decode disaggregation in the engine: the prefill and decode roles a server takes
(`roles.py`) and their settings. The KV moves over `kvabi/transfer`; requests are routed by
`kvabi/routing` (docs/ARCHITECTURE.md)."""
