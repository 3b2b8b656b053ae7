"""The engine's KV cache: block bookkeeping (pure Python) and the tensors it indexes."""
