"""`ServerSettings`: what the server is told at start-up (the engine has its own config)."""

from __future__ import annotations

from dataclasses import dataclass

HEADER_TIMEOUT_S = 10.0  # a request's line and headers must arrive within this
BODY_TIMEOUT_S = 30.0  # and its body within this after them (then 408)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients send as `model` (and /v1/models lists)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_body_bytes: int = 4 * 2**20
    max_queued: int = 256  # requests that may wait beyond the engine's max_num_seqs
    retry_after_s: int = 1  # told to clients refused for load
    kv_events: str | None = None  # ZMQ endpoint to publish block events on (vLLM's format)
    kv_events_replay: str | None = None  # ZMQ endpoint answering replay requests
    kv_events_format: str = "map"  # vLLM's named-field events, or "array" (positional)
    stall_timeout_s: float = 30.0  # /health says 503 once work waits this long without progress
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it unset for no key)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued: must be >= 0, got {self.max_queued}")
        for name in ("stall_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s: must be >= 0, got {self.retry_after_s}")
