"""A mixed load: a steady stream of short prompts that decode many tokens, and long prompts
arriving while they decode (the interference prefill/decode disaggregation exists to remove).

Short requests arrive as a Poisson process (`serve_load.make_requests`); long ones at fixed
times spread over the stream, so each lands while short requests are decoding. Prompts and
lengths are seeded: every setup measured against the same `MixedLoad` gets the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

from kvabi.bench.serve_load import RequestSpec, WorkloadConfig, make_requests

KINDS = ("short", "long")
T = TypeVar("T")


@dataclass(frozen=True)
class MixedLoad:
    num_short: int
    short_input_len: int  # mean prompt words (about one token each)
    short_output_len: int  # mean max_tokens
    short_rate: float  # short requests per second (Poisson)
    num_long: int
    long_input_len: int
    long_output_len: int
    long_start_s: float  # the first long prompt arrives this long after the first short one
    long_gap_s: float  # then one every `long_gap_s`
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_short, self.num_long) < 1 or self.short_rate <= 0:
            raise ValueError("num_short, num_long: must be >= 1; short_rate: must be > 0")
        if self.long_start_s < 0 or self.long_gap_s < 0:
            raise ValueError("long_start_s, long_gap_s: must be >= 0")

    def short_workload(self) -> WorkloadConfig:
        return WorkloadConfig(
            self.num_short, self.short_input_len, self.short_output_len, 0.25, seed=self.seed
        )

    def long_workload(self) -> WorkloadConfig:
        return WorkloadConfig(
            self.num_long, self.long_input_len, self.long_output_len, 0.25, seed=self.seed + 1000
        )


@dataclass(frozen=True)
class MixedRequest:
    kind: str  # "short" or "long"
    spec: RequestSpec


def make_mixed(load: MixedLoad) -> list[MixedRequest]:
    """Every request of the load, ordered by arrival (what `serve_load.run_load` expects)."""
    short = [
        MixedRequest("short", s) for s in make_requests(load.short_workload(), load.short_rate)
    ]
    long = [
        MixedRequest("long", replace(s, arrival_s=load.long_start_s + i * load.long_gap_s))
        for i, s in enumerate(make_requests(load.long_workload(), float("inf")))
    ]
    return sorted(short + long, key=lambda r: r.spec.arrival_s)


def of_kind(requests: list[MixedRequest], results: list[T], kind: str) -> list[T]:
    """The entries of `results` (one per request, in the load's order) of `kind` requests."""
    return [
        result for request, result in zip(requests, results, strict=True) if request.kind == kind
    ]
