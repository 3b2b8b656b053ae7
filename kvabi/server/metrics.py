"""/metrics: Prometheus counters and latency histograms, plus the engine's gauges.

Counters and histograms are fed on the event loop as requests progress (`ServerMetrics` is the
`AsyncEngine`'s observer). Gauges come from the engine thread's latest `EngineSnapshot` through a
custom collector, so their names can be dynamic: each entry of `LLMEngine.cache_stats()` (the
prefix cache's figures, where the engine has it) is exported as `kvabi_cache_<name>`, but a
request tag's figures as `kvabi_cache_tag_<figure>{tag="<tag as given>"}`.
Each app has its own registry (no process-wide globals).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvabi.cache.cache_stats import TAG_FIGURES
from kvabi.engine.async_engine import EngineSnapshot
from kvabi.engine.request_handle import Progress, RequestHandle

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's metrics in their own registry; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "kvabi_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.requests = Counter(
            "kvabi_requests", "engine requests that ended, by outcome", ["outcome"], registry=r
        )
        self.choices = Counter(
            "kvabi_choices_finished", "finished choices by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("kvabi_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(
            "kvabi_generation_tokens", "tokens generated (all choices)", registry=r
        )
        self.ttft = self._histogram("kvabi_time_to_first_token_seconds", "time to first token")
        self.itl = self._histogram(
            "kvabi_inter_token_latency_seconds", "time between a request's token steps"
        )
        self.e2e = self._histogram("kvabi_e2e_request_latency_seconds", "arrival to last token")

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def watch_engine(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        """Export the gauges of the engine whose latest snapshot `snapshot()` returns."""
        self.registry.register(EngineCollector(snapshot))

    def admitted(self, handle: RequestHandle) -> None:
        self.prompt_tokens.inc(len(handle.prompt_ids))

    def updated(self, handle: RequestHandle, progress: Progress) -> None:
        self.generation_tokens.inc(progress.num_new_tokens)
        if progress.ttft is not None:
            self.ttft.observe(progress.ttft)
        if progress.itl is not None:
            self.itl.observe(progress.itl)

    def ended(self, handle: RequestHandle, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        if outcome != "finished":
            return
        self.e2e.observe((handle.last_token_time or time.perf_counter()) - handle.arrival)
        for reason in handle.finish_reasons:
            self.choices.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Gauges read from the engine thread's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names depend on the engine (cache_stats): nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        used = s.num_blocks - s.num_free_blocks
        yield _gauge("kvabi_kv_blocks_total", "KV cache blocks in the pool", s.num_blocks)
        yield _gauge("kvabi_kv_blocks_used", "KV cache blocks in use", used)
        yield _gauge("kvabi_kv_blocks_free", "KV cache blocks free", s.num_free_blocks)
        yield _gauge("kvabi_requests_running", "sequences being computed", s.num_running)
        yield _gauge("kvabi_requests_waiting", "sequences waiting to be admitted", s.num_waiting)
        yield CounterMetricFamily(
            "kvabi_preemptions", "sequences preempted (recomputed later)", value=s.num_preemptions
        )
        tagged = {f"tag_{tag}_{figure}" for tag in s.cache_tags for figure in TAG_FIGURES}
        for name, value in s.spec_stats.items():  # vLLM's spec_decode_* names
            yield _gauge(f"kvabi_{name}", "speculative decoding since start", value)
        for name, value in s.cache_stats.items():
            if name not in tagged:  # the rest are [a-z0-9_] (cache_stats.py)
                yield _gauge(f"kvabi_cache_{name}", f"engine cache_stats()['{name}']", value)
        for figure in TAG_FIGURES if s.cache_tags else ():
            metric = GaugeMetricFamily(
                f"kvabi_cache_tag_{figure}",
                f"prefix cache {figure} per request tag",
                labels=["tag"],
            )
            for tag in s.cache_tags:
                metric.add_metric([tag], s.cache_stats[f"tag_{tag}_{figure}"])
            yield metric


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
