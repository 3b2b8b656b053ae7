"""`ServerSettings`: what the server is told at start-up (the engine has its own config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients send as `model` (and /v1/models lists)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    max_body_bytes: int = 4 * 2**20
    max_queued: int = 256  # requests that may wait beyond the engine's max_num_seqs
    retry_after_s: int = 1  # told to clients refused for load
    kv_events: str | None = None  # ZMQ endpoint to publish block events on (vLLM's format)
    kv_events_replay: str | None = None  # ZMQ endpoint answering replay requests

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it unset for no key)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued: must be >= 0, got {self.max_queued}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s: must be >= 0, got {self.retry_after_s}")
