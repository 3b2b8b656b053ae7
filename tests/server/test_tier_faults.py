"""`kvabi serve --redis-tier` with a value in Redis that kvabi did not write: every request is
served, no block stays taken, /health stays truthful (a real server process, a real Redis)."""

from __future__ import annotations

import re

import httpx
import redis

from kvabi.server.launch import ServerProcess
from tests.cache.redis_server import redis_server  # noqa: F401 - a fixture
from tests.server.tiny_server import MODEL, free_blocks, tiny_folder


def test_a_bad_redis_value_costs_a_served_request_nothing(tmp_path, redis_server):  # noqa: F811
    folder = tiny_folder(tmp_path / "tiny")
    args = ["--model", str(folder), "--served-model-name", MODEL, "--dtype", "fp32"]
    args += ["--block-size", "4", "--num-blocks", "24", "--redis-tier", redis_server.url]
    prompts = [list(range(10 + 40 * i, 50 + 40 * i)) for i in range(3)]  # 10 blocks each
    with ServerProcess(args, startup_timeout_s=120) as server:

        def complete(ids: list[int]) -> httpx.Response:
            body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{server.base_url}/completions", json=body, timeout=30)

        want = [complete(p).json()["choices"][0]["text"] for p in prompts]  # evicts to Redis
        redis.Redis.from_url(redis_server.url).set("kvabi:bytes", b"12x34")
        for _ in range(3):  # before: two 500s, then every request hung on a drained pool
            got = [complete(p) for p in prompts]
            assert [r.status_code for r in got] == [200] * 3
            assert [r.json()["choices"][0]["text"] for r in got] == want
            assert free_blocks(server.url) == (24, 24)
            assert httpx.get(f"{server.url}/health").status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        assert float(re.search(r"^kvabi_cache_tier_redis_failures (\S+)$", metrics, re.M)[1]) > 0
