"""One vLLM process with kvabi's KV connector: run prompts in order, report tokens and hits.

Runs in vLLM's interpreter with the repo on PYTHONPATH (like vllm_kv_worker.py):

    PYTHONPATH=. .venv-vllm/bin/python kvabi/connectors/vllm_connector_worker.py --job J --out R

Job: {"model_dir", "dtype", "store" (the store's descriptor JSON), "prompts" ([{"ids": [...],
"cache_salt": optional}]), "max_tokens", "disk_dir" (or null), "redis_url" (or null),
"connector" (default true: false runs vLLM alone), "prefix_caching" (vLLM's own; default
false, so that every cached token a request reports came through the connector), "together"
(default false: the prompts go to vLLM in one call, all in flight at once, rather than in turn),
"async_load" (the connector's: "auto", true, false)}.
The result has each prompt's tokens, cached tokens, wall time and TTFT (from vLLM's request
metrics), and the worker-side connector's transfer stats.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(ENV)  # read when vllm is imported: set first
    import vllm
    from vllm.config import KVTransferConfig

    start = time.perf_counter()
    extra = {"store": job["store"], "disk_dir": job["disk_dir"], "redis_url": job["redis_url"],
             "async_load": job.get("async_load", "auto")}  # fmt: skip
    config = KVTransferConfig(
        kv_connector="KvabiConnector",
        kv_connector_module_path="kvabi.connectors.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    use_connector = job.get("connector", True)
    llm = vllm.LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=job.get("prefix_caching", False),
        kv_transfer_config=config if use_connector else None,
        disable_log_stats=False,  # per-request metrics: the TTFT
        seed=0,
    )
    startup = time.perf_counter() - start
    params = vllm.SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    inputs = []
    for prompt in job["prompts"]:
        inputs.append({"prompt_token_ids": prompt["ids"]})
        if prompt.get("cache_salt"):
            inputs[-1]["cache_salt"] = prompt["cache_salt"]
    # one at a time (each may load what the previous saved), or all in one call
    batches = [inputs] if job.get("together") else [[one] for one in inputs]
    runs = []
    for batch in batches:
        begin = time.perf_counter()
        for out in llm.generate(batch, params, use_tqdm=False):
            runs.append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens,
                    "wall_s": time.perf_counter() - begin,
                    "ttft_s": out.metrics.first_token_latency if out.metrics else None,
                }
            )
    return {"startup_s": startup, "runs": runs, "transfer": _transfer_stats(llm, use_connector)}


def _transfer_stats(llm: Any, use_connector: bool) -> dict[str, Any] | None:
    """The connector's stats, both sides (the engine runs in this process)."""
    if not use_connector:
        return None
    from dataclasses import asdict

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = asdict(llm.llm_engine.engine_core.engine_core.scheduler.connector.stats)
    worker = asdict(get_kv_transfer_group().stats)
    return {k: scheduler[k] + worker[k] for k in worker}  # each side counts its own fields


def main(argv: list[str] | None = None) -> int:
    from kvabi.connectors.vllm_kv_worker import job_main

    return job_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
