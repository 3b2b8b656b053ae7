"""`SamplingParams`: how one request's tokens are chosen, checked before any work starts.

As in vLLM, a temperature below `SAMPLING_EPS` (1e-5) is greedy: dividing logits by it could
only overflow, and no sampler can tell such a distribution from its argmax. Values that cannot
be sampled (infinite or NaN temperature or top_p) are refused here, before a request exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # temperatures below it are greedy (vLLM's _SAMPLING_EPS)
MAX_TAG_CHARS = 128


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-shaped sampling parameters. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return per token (0: the sampled one only)
    cache_salt: str | None = None  # tenant: enters the block hash, so tenants never share blocks
    session: str | None = None  # a conversation whose blocks are demoted, not dropped, when idle
    tag: str | None = None  # application label for per-tag cache metrics (e.g. template name)
    press: str | None = None  # evict context tokens at prefill (press.py), e.g. "snapkv:ratio=0.5"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature",
                "must be finite and >= 0",
                self.temperature,
            ),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)", self.top_k),
            (1 <= self.n <= 64, "n", "must be in [1, 64]", self.n),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                "must be in [0, 20]",
                self.logprobs,
            ),
            (all(s for s in self.stop), "stop", "stop strings must be non-empty", self.stop),
            (self.cache_salt != "", "cache_salt", "must be non-empty (omit it for none)", ""),
            (
                self.tag is None or 0 < len(self.tag) <= MAX_TAG_CHARS,
                "tag",
                f"must have 1 to {MAX_TAG_CHARS} characters",
                self.tag,
            ),
        ]
        for ok, name, rule, value in checks:
            if not ok:
                raise ValueError(f"{name}: {rule}, got {value!r}")
        if self.press is not None:
            from kvabi.engine.press import PressConfig

            PressConfig.parse(self.press)  # a bad press string is refused here

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
