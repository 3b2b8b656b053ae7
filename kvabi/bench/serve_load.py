"""An open-loop load on an OpenAI endpoint: seeded requests sent at Poisson arrival times.

Open loop: each request goes out at its arrival time whether or not earlier ones have finished,
so an overloaded server shows as growing latency rather than a slower sender. Prompts are words
drawn from a list of common English words (about one token each in byte-level BPE vocabularies);
lengths are seeded and independent of the rate, so every rate sends the same requests. Optional
shared prefixes put one of a few fixed word runs in front of each prompt.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = (  # noqa: SIM905 - prose is easier to read than an 80-item literal
    "the of and to in is was for on that with as by at from his her are be this had not but "
    "what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more two time like him see no "
    "could way my than first water been call who its now find long down day did get come "
    "made may part"
).split()


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    input_len: int  # mean prompt length in words (shared prefix included)
    output_len: int  # mean max_tokens
    len_spread: float = 0.5  # lengths uniform in mean * [1 - spread, 1 + spread]
    prefix_len: int = 0  # words of shared prefix in front of every prompt
    num_prefixes: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len, output_len: must be >= 1")
        if not 0 <= self.len_spread < 1:
            raise ValueError(f"len_spread: must be in [0, 1), got {self.len_spread}")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ValueError("prefix_len: must be >= 0; num_prefixes: must be >= 1")


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # seconds after the start of the run
    prompt: str
    max_tokens: int


def make_requests(config: WorkloadConfig, rate: float) -> list[RequestSpec]:
    """The seeded requests, arriving as a Poisson process of `rate` per second (inf: at once)."""
    content = random.Random(config.seed)
    arrivals = random.Random(config.seed + 1)  # separate, so every rate sends the same requests
    prefixes = [_words(content, config.prefix_len) for _ in range(config.num_prefixes)]
    specs, now = [], 0.0
    for _ in range(config.num_requests):
        total = _spread(content, config.input_len, config.len_spread)
        prefix = content.choice(prefixes)
        own = _words(content, max(total - config.prefix_len, 1))
        max_tokens = _spread(content, config.output_len, config.len_spread)
        specs.append(RequestSpec(now, f"{prefix} {own}".strip(), max_tokens))
        now += arrivals.expovariate(rate) if rate != float("inf") else 0.0
    return specs


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _spread(rng: random.Random, mean: int, spread: float) -> int:
    return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))


@dataclass
class RequestResult:
    ok: bool = False
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks that carried text
    e2e_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # ends in /v1
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # exact output lengths (a vLLM extension kvabi also takes)

    def body(self, spec: RequestSpec) -> dict:
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return {**body, "ignore_eos": True} if self.ignore_eos else body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def send(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec) -> RequestResult:
    """One streamed completion, timed from just before it is sent."""
    result, start = RequestResult(), time.perf_counter()
    try:
        async with client.stream(
            "POST",
            f"{endpoint.base_url}/completions",
            json=endpoint.body(spec),
            headers=endpoint.headers(),
        ) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            await _read_events(response, result, start)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_events(response: httpx.Response, result: RequestResult, start: float) -> None:
    last = start
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            result.error = str(event["error"].get("message"))
            return
        if event.get("usage"):
            result.prompt_tokens = event["usage"]["prompt_tokens"]
            result.output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices", [])):
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
    result.ok, result.e2e_s = True, time.perf_counter() - start


async def run_load(
    endpoint: Endpoint, specs: list[RequestSpec], timeout_s: float = 600.0
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time; returns the results and the run's duration."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start, tasks = time.perf_counter(), []
        for spec in specs:
            await asyncio.sleep(max(start + spec.arrival_s - time.perf_counter(), 0.0))
            tasks.append(asyncio.create_task(send(client, endpoint, spec)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
