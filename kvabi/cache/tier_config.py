"""`TierConfig`: which tiers sit below the engine's pool, and how big each is."""

from __future__ import annotations

from dataclasses import dataclass

from kvabi.cache.disk_tier import DiskTier
from kvabi.cache.host_tier import HostTier
from kvabi.cache.tier import KVTier


@dataclass(frozen=True)
class TierConfig:
    """Lower tiers, looked up in this order: host RAM, local disk, Redis. None configured (the
    default) means the pool is the only tier."""

    host_bytes: int = 0  # host RAM tier capacity; 0 = no host tier
    disk_dir: str | None = None  # local disk tier folder (one subfolder per model); None = none
    disk_bytes: int = 8 * 2**30
    redis_url: str | None = None  # e.g. "redis://127.0.0.1:6379/0"; None = no remote tier
    redis_bytes: int = 2**30
    redis_namespace: str = "kvabi"
    redis_timeout_s: float = 0.25  # per call; a slower server counts as down
    redis_retry_s: float = 1.0  # after a failure, how long the tier stays down before retrying
    write_queue_bytes: int = 256 * 2**20  # snapshots waiting to be written; beyond: dropped

    def __post_init__(self) -> None:
        checks = [
            (self.host_bytes >= 0, "host_bytes", "must be >= 0", self.host_bytes),
            (self.disk_bytes >= 1, "disk_bytes", "must be >= 1", self.disk_bytes),
            (self.redis_bytes >= 1, "redis_bytes", "must be >= 1", self.redis_bytes),
            (self.redis_timeout_s > 0, "redis_timeout_s", "must be > 0", self.redis_timeout_s),
            (self.redis_retry_s >= 0, "redis_retry_s", "must be >= 0", self.redis_retry_s),
            (self.write_queue_bytes >= 1, "write_queue_bytes", "must be >= 1", 0),
            (self.disk_dir != "", "disk_dir", "must be a folder or None", self.disk_dir),
            (self.redis_url != "", "redis_url", "must be a URL or None", self.redis_url),
        ]
        for ok, name, rule, value in checks:
            if not ok:
                raise ValueError(f"tiers.{name}: {rule}, got {value!r}")

    @property
    def is_enabled(self) -> bool:
        """Whether any tier below the pool is configured."""
        return bool(self.host_bytes or self.disk_dir or self.redis_url)

    def build(self, compat_digest: str) -> list[KVTier]:
        """The configured tiers, in lookup order (the disk tier warm-starts from its folder)."""
        tiers: list[KVTier] = []
        if self.host_bytes:
            tiers.append(HostTier(self.host_bytes))
        if self.disk_dir:
            tiers.append(DiskTier(self.disk_dir, self.disk_bytes, compat_digest))
        if self.redis_url:
            from kvabi.cache.redis_tier import RedisTier  # redis-py only when configured

            tiers.append(
                RedisTier(
                    self.redis_url,
                    self.redis_bytes,
                    self.redis_namespace,
                    self.redis_timeout_s,
                    self.redis_retry_s,
                )
            )
        return tiers
