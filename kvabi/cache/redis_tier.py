"""`RedisTier`: entries in a Redis server that several engine instances share.

Keys (`<ns>` is the configured namespace, default `kvabi`):
- `<ns>:block:<hash hex>`: one entry (an ABI container, so instances with different native
  layouts can share it; the reader converts);
- `<ns>:lru`: a sorted set of entry keys scored by last use (seconds since the epoch): the
  tier's own LRU, shared by every instance;
- `<ns>:bytes`: the total bytes of the entries.
A put runs one Lua script (store, score, count, evict the oldest while over capacity), so
concurrent instances keep the three consistent. The block hash binds the model, so models can
share one namespace without ever reading each other's entries. The tier manages its own
capacity: run the server without a `maxmemory` eviction policy, which would drop entries behind
the LRU set's back (they then read as misses, and `<ns>:bytes` overcounts).

Faults: every call has a short timeout and no retries. A failure (the server gone, or a value
this code did not write, e.g. `<ns>:bytes` that is not a number) raises; `KVTier` counts it and
marks the tier down for `retry_s` seconds (it answers "absent" at once meanwhile, so the step
loop never waits on a dead server), and the next call after that reconnects.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvabi.cache.tier import KVTier

_PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[2], KEYS[1])
  return {0, 0, tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('ZCARD', KEYS[2])}
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[1]))
local evicted = 0
while total > tonumber(ARGV[3]) do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', oldest[1]))
  redis.call('DEL', oldest[1])
  evicted = evicted + 1
end
return {1, evicted, total, redis.call('ZCARD', KEYS[2])}
"""

_REMOVE = """
local n = redis.call('STRLEN', KEYS[1])
if redis.call('DEL', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[3], n) end
redis.call('ZREM', KEYS[2], KEYS[1])
return n
"""


class RedisTier(KVTier):
    name = "redis"

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        namespace: str = "kvabi",
        timeout_s: float = 0.25,
        retry_s: float = 1.0,
    ) -> None:
        super().__init__(capacity_bytes, retry_s)
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self.namespace = namespace
        self._lru_key, self._bytes_key = f"{namespace}:lru", f"{namespace}:bytes"
        self._put_script = self.client.register_script(_PUT)
        self._remove_script = self.client.register_script(_REMOVE)
        self._seen = (0, 0)  # (bytes, entries) as of this process's last put or get

    @property
    def num_bytes(self) -> int:
        return self._seen[0]

    @property
    def num_blocks(self) -> int:
        return self._seen[1]

    def key(self, block_hash: bytes) -> str:
        """The Redis key of this hash's entry."""
        return f"{self.namespace}:block:{block_hash.hex()}"

    def _contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        scores = self.client.zmscore(self._lru_key, [self.key(h) for h in block_hashes])
        return [s is not None for s in scores]

    def _get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        keys = [self.key(h) for h in block_hashes]
        pipe = self.client.pipeline(transaction=False)
        pipe.mget(keys)
        pipe.zadd(self._lru_key, dict.fromkeys(keys, time.time()), xx=True)
        pipe.get(self._bytes_key).zcard(self._lru_key)
        entries, _, total, count = pipe.execute()
        self._seen = (int(total or 0), int(count))
        return [e if isinstance(e, bytes) else None for e in entries]

    def _put(self, block_hash: bytes, entry: bytes | memoryview) -> None:
        keys = [self.key(block_hash), self._lru_key, self._bytes_key]
        result = self._put_script(keys=keys, args=[entry, time.time(), self.capacity_bytes])
        wrote, evicted, total, count = (int(x) for x in result)
        self._seen = (total, count)
        if wrote:
            self.stats.add(writes=1, write_bytes=len(entry), evictions=evicted)

    def _remove(self, block_hash: bytes) -> None:
        self._remove_script(keys=[self.key(block_hash), self._lru_key, self._bytes_key])

    def close(self) -> None:
        self.client.close()
