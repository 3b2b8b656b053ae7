"""`PrefixRouting`: the router's choice of instance by cached prefix, then by load.

The router follows each instance's KV events (`KVEventSubscriber`, one thread per instance)
into a `PrefixIndex`. For a request it needs the request's block hashes, which need the token
ids after the chat template and the hash root (the model's compat digest and the cache salt):
the router holds no model, so it asks one instance (`POST /kvabi/tokenize/v1/...`, the same
body) for `token_ids` and `hash_root`, and hashes them for each block size its instances use
(`hash_blocks`, docs/ABI.md section 4), or by the scheme a peer deployment's events use
(`PromptHashing`, `--hash-scheme`). That costs one local round trip per request, and only
while some instance reports cached blocks; in exchange the router needs no tokenizer or weights
and stays right when the template or the tokenizer changes with the model.
Instances are ordered by cached prefix (tokens, longest first), then by requests in flight at
the router, then round robin (the order they come in).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import httpx

from kvabi.routing.kv_event_subscriber import KVEventSubscriber
from kvabi.routing.prefix_index import PrefixIndex
from kvabi.routing.prompt_hashing import PromptHashing

log = logging.getLogger("kvabi.router")
TOKENIZE_PREFIX = "/kvabi/tokenize"


@dataclass(frozen=True)
class EventSource:
    url: str  # the instance's server URL, as the router names it
    endpoint: str  # the ZMQ endpoint it publishes its KV events on (`kvabi serve --kv-events`)


@dataclass(frozen=True)
class PromptHashes:
    """A request's prompt as the instances see it, hashed per block size."""

    num_tokens: int
    hashes_by_size: dict[int, list[bytes]]


class PrefixRouting:
    def __init__(
        self,
        sources: Sequence[EventSource],
        client: httpx.AsyncClient,
        hashing: PromptHashing = PromptHashing(),
    ) -> None:
        self.sources, self.client, self.hashing = tuple(sources), client, hashing
        self.index = PrefixIndex()
        self.in_flight: Counter[str] = Counter()  # requests the router has at each instance
        self._subscribers: list[KVEventSubscriber] = []

    def start(self) -> None:
        """Follow every source's events (the sockets connect; publishers may come later)."""
        for s in self.sources:
            on_batch = partial(self.index.apply, s.url)
            self._subscribers.append(KVEventSubscriber(s.endpoint, on_batch).start())

    def close(self) -> None:
        for subscriber in self._subscribers:
            subscriber.close()
        self._subscribers = []

    async def cached_tokens(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> dict[str, int]:
        """Each followed instance's cached prefix of this request, in tokens ({} when nothing
        is cached anywhere or the prompt cannot be hashed: the choice falls back to load)."""
        if not any(self.index.num_blocks().values()):
            return {}
        prompt = await self.prompt_hashes(path, body, headers)
        if prompt is None:
            return {}
        return self.index.match([s.url for s in self.sources], prompt.hashes_by_size)

    async def prompt_hashes(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> PromptHashes | None:
        """Ask the least loaded instance that answers for the prompt's ids and hash root."""
        for url in self.order([s.url for s in self.sources], 0, {}):
            try:
                r = await self.client.post(
                    url + TOKENIZE_PREFIX + path, content=body, headers=headers, timeout=5.0
                )
            except httpx.TransportError:
                continue
            if r.status_code != 200:
                return None  # a bad request: the instance it goes to answers with the error
            answer = r.json()
            ids, root = answer["token_ids"], bytes.fromhex(answer["hash_root"])
            sizes = self.index.block_sizes() or {int(answer["block_size"])}
            salt = _cache_salt(body) if self.hashing.takes_salt else None  # else: in `root`
            hashes = self.hashing.hashes(ids, sizes, root, salt)
            return PromptHashes(len(ids), hashes)
        return None

    def order(self, urls: Sequence[str], turn: int, cached: dict[str, int]) -> list[str]:
        """`urls` by cached tokens (most first), then in-flight requests (fewest first), then
        round robin from `turn`."""
        n = len(urls)
        rotated = [urls[(turn + i) % n] for i in range(n)]
        return sorted(rotated, key=lambda u: (-cached.get(u, 0), self.in_flight[u]))


def _cache_salt(body: bytes) -> str | None:
    try:
        salt = json.loads(body).get("cache_salt")
    except (ValueError, AttributeError):
        return None
    return salt if isinstance(salt, str) else None
