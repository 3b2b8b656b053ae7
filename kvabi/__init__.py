"""kvabi: an ABI for the LLM KV cache, and an engine that proves it."""

__version__ = "0.1.0"
