"""`CacheStats`: prefix-cache metrics per request tag, and the flat form every exporter reads.

`flat_stats` is the contract behind `LLMEngine.cache_stats()` (the server exports it as
Prometheus gauges): a `dict[str, float]`, names made of `[a-z0-9_]` except a tag's own part.

- `prefix_queries`, `prefix_query_tokens`, `prefix_hit_tokens`, `prefix_hit_rate`,
  `prefix_saved_tokens` (prefill tokens not computed), `prefix_cow_copies`: one query per
  request, at its first admission; hits count blocks found in any tier.
- `tag_<tag>_queries`, `_query_tokens`, `_hit_tokens`, `_hit_rate`, `_saved_tokens` per
  request tag (`SamplingParams.tag`), the tag exactly as given (distinct tags never share a
  name; the server exports them with the tag as a label); past `MAX_TAGS` tags the rest add up
  under `tags_other_*`. `TAG_FIGURES` names the figures.
- `tier_pool_*` (the engine's block pool): `blocks`, `cached_blocks`, `bytes` (blocks holding
  live or cached KV), `capacity_bytes`, `evictions`, `query_tokens`, `hit_tokens` (hits that
  were already in the pool), `hit_rate`.
- `tier_<name>_*` for `host`, `disk`, `redis`: `queries`, `query_tokens`, `hit_tokens`,
  `hit_rate`, `loads`, `load_seconds`, `load_latency_ms` (mean per load), `writes`,
  `write_bytes`, `evictions`, `failures`, `corrupt`, `refused`, `bytes`, `blocks`,
  `capacity_bytes`, and `tier_<name>_up` (Redis: 0 while marked down).
- `tier_write_queued_bytes`, `tier_write_dropped_blocks`, `tier_write_errors` (the
  write-down queue).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvabi.cache.block_pool import BlockPool
from kvabi.cache.tier import KVTier
from kvabi.cache.tier_writer import TierWriter

MAX_TAGS = 64
TAG_FIGURES = ("queries", "query_tokens", "hit_tokens", "hit_rate", "saved_tokens")


@dataclass
class QueryStats:
    """Prefix lookups: how many, over how many prompt tokens, and how many tokens were cached."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    def record(self, num_tokens: int, num_cached_tokens: int) -> None:
        """One lookup of a `num_tokens`-token prompt that found `num_cached_tokens` cached."""
        self.queries += 1
        self.query_tokens += num_tokens
        self.hit_tokens += num_cached_tokens

    def flat(self, prefix: str) -> dict[str, float]:
        """The counters and the hit rate, named `<prefix>_<counter>`."""
        return {
            f"{prefix}_queries": self.queries,
            f"{prefix}_query_tokens": self.query_tokens,
            f"{prefix}_hit_tokens": self.hit_tokens,
            f"{prefix}_hit_rate": _rate(self.hit_tokens, self.query_tokens),
            f"{prefix}_saved_tokens": self.hit_tokens,
        }


@dataclass
class CacheStats:
    """Counters the scheduler and engine update; tiers keep their own (`TierStats`)."""

    prefix: QueryStats = field(default_factory=QueryStats)
    tags: dict[str, QueryStats] = field(default_factory=dict)  # by tag, as given
    other_tags: QueryStats = field(default_factory=QueryStats)  # tags past MAX_TAGS
    num_cow_copies: int = 0

    def record_query(self, tag: str | None, num_tokens: int, num_cached_tokens: int) -> None:
        """One request's lookup at its first admission."""
        self.prefix.record(num_tokens, num_cached_tokens)
        if tag is not None:
            self._tag(tag).record(num_tokens, num_cached_tokens)

    def _tag(self, tag: str) -> QueryStats:
        if tag not in self.tags and len(self.tags) >= MAX_TAGS:
            return self.other_tags
        return self.tags.setdefault(tag, QueryStats())


def flat_stats(
    stats: CacheStats,
    pool: BlockPool,
    block_bytes: int,
    tiers: Sequence[KVTier] = (),
    writer: TierWriter | None = None,
) -> dict[str, float]:
    """Every cache metric as one flat `name -> value` dict (module docstring lists the names)."""
    out = stats.prefix.flat("prefix") | {"prefix_cow_copies": stats.num_cow_copies}
    for tag, tag_stats in sorted(stats.tags.items()):
        out |= tag_stats.flat(f"tag_{tag}")
    if stats.other_tags.queries:
        out |= stats.other_tags.flat("tags_other")
    out |= _pool_stats(stats, pool, block_bytes, tiers)
    for tier in tiers:
        out |= _tier_stats(tier)
    if writer is not None:
        out["tier_write_queued_bytes"] = writer.num_queued_bytes
        out["tier_write_dropped_blocks"] = writer.num_dropped_blocks
        out["tier_write_errors"] = writer.num_errors
    return {name: float(value) for name, value in out.items()}


def _pool_stats(
    stats: CacheStats, pool: BlockPool, block_bytes: int, tiers: Sequence[KVTier]
) -> dict[str, float]:
    lower = sum(t.stats.hit_tokens for t in tiers)
    hits = max(stats.prefix.hit_tokens - lower, 0)
    in_use = pool.num_blocks - pool.num_free + pool.num_free_cached
    return {
        "tier_pool_blocks": pool.num_blocks,
        "tier_pool_cached_blocks": pool.num_cached,
        "tier_pool_bytes": in_use * block_bytes,
        "tier_pool_capacity_bytes": pool.num_blocks * block_bytes,
        "tier_pool_evictions": pool.num_evictions,
        "tier_pool_query_tokens": stats.prefix.query_tokens,
        "tier_pool_hit_tokens": hits,
        "tier_pool_hit_rate": _rate(hits, stats.prefix.query_tokens),
    }


def _tier_stats(tier: KVTier) -> dict[str, float]:
    c = tier.stats.counters()
    out = {f"tier_{tier.name}_{name}": value for name, value in c.items()}
    p = f"tier_{tier.name}"
    out[f"{p}_hit_rate"] = _rate(c["hit_tokens"], c["query_tokens"])
    out[f"{p}_load_latency_ms"] = 1e3 * c["load_seconds"] / c["loads"] if c["loads"] else 0.0
    out[f"{p}_bytes"] = tier.num_bytes
    out[f"{p}_blocks"] = tier.num_blocks
    out[f"{p}_capacity_bytes"] = tier.capacity_bytes
    out[f"{p}_up"] = 0.0 if tier.is_down else 1.0
    return out


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
