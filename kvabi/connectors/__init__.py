"""Plug-ins that make other engines use kvabi's store (vLLM's KV connector)."""
