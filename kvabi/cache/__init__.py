"""The engine's KV cache: block bookkeeping and the prefix cache (pure Python over ids and
hashes), the tensors they index, and the tiers below the pool (host RAM, disk, Redis)."""
