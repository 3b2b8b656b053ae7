"""vLLM's own block hashing as the oracle for kvabi/abi/hash_schemes.py (runs in .venv-vllm).

    .venv-vllm/bin/python tests/abi/vllm_hash_oracle.py JOBS.json OUT.json

Each job: {"op": "chain", "algo": "sha256_cbor" | "sha256", "seed": str | null (PYTHONHASHSEED;
null: unset), "block_size", "token_ids", "extra_keys": null | one entry per full block} runs
`init_none_hash` and `hash_block_tokens` block by block; {"op": "request", ... "cache_salt",
"lora": [name, id, path] | null} builds a vLLM `Request` and hashes it with
`get_request_block_hasher` (vLLM makes the extra keys). {"op": "cbor", "values": [...]} returns
`cbor2.dumps(v, canonical=True)`. {"op": "events", ...} (see `events`): vLLM's KV event
bytes. JSON values are tagged: {"b": hex} bytes, {"t": [...]} a
tuple, {"m": [[k, v], ...]} a dict. Answers: hex strings, in job order.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def untag(value: Any) -> Any:
    if isinstance(value, list):
        return [untag(v) for v in value]
    if isinstance(value, dict) and "b" in value:
        return bytes.fromhex(value["b"])
    if isinstance(value, dict) and "t" in value:
        return tuple(untag(v) for v in value["t"])
    if isinstance(value, dict) and "m" in value:
        return {untag(k): untag(v) for k, v in value["m"]}
    return value


def _init(job: dict[str, Any]) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    os.environ.pop("PYTHONHASHSEED", None)
    if job["seed"] is not None:
        os.environ["PYTHONHASHSEED"] = job["seed"]
    fn = get_hash_fn_by_name(job["algo"])
    kv_cache_utils.init_none_hash(fn)
    return fn


def chain(job: dict[str, Any]) -> list[str]:
    from vllm.v1.core import kv_cache_utils

    fn, bs, ids = _init(job), job["block_size"], job["token_ids"]
    extras = untag(job["extra_keys"])
    parent, out = None, [kv_cache_utils.NONE_HASH.hex()]
    for i in range(len(ids) // bs):
        keys = None if extras is None else extras[i]
        parent = kv_cache_utils.hash_block_tokens(fn, parent, ids[i * bs : (i + 1) * bs], keys)
        out.append(parent.hex())
    return out  # the root, then one hash per full block


def request(job: dict[str, Any]) -> list[str]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = _init(job)
    lora = LoRARequest(*job["lora"]) if job["lora"] else None
    req = Request(
        "r0", job["token_ids"], SamplingParams(max_tokens=1), None,
        lora_request=lora, cache_salt=job["cache_salt"],
        block_hasher=kv_cache_utils.get_request_block_hasher(job["block_size"], fn),
    )  # fmt: skip
    return [kv_cache_utils.NONE_HASH.hex()] + [h.hex() for h in req.block_hashes]


def events(job: dict[str, Any]) -> list[str]:
    """A `KVEventBatch` of one `BlockStored` of the chain of `token_ids` (the "chain" job's
    fields), as vLLM's `ZmqEventPublisher` encodes it; `int_hashes`: with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, hashes go out as vLLM's `maybe_convert_block_hash`."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.core import kv_cache_utils

    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if job["int_hashes"] else "0"
    hashes = [bytes.fromhex(h) for h in chain({"extra_keys": None, **job})[1:]]
    num_tokens = len(hashes) * job["block_size"]
    stored = BlockStored(
        block_hashes=[kv_cache_utils.maybe_convert_block_hash(h) for h in hashes],
        parent_block_hash=None, token_ids=job["token_ids"][:num_tokens],
        block_size=job["block_size"], lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    batch = KVEventBatch(ts=1.0, events=[stored])
    return [msgspec.msgpack.Encoder().encode(batch).hex()]


def cbor(job: dict[str, Any]) -> list[str]:
    import cbor2

    return [cbor2.dumps(untag(v), canonical=True).hex() for v in job["values"]]


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    ops = {"chain": chain, "request": request, "cbor": cbor, "events": events}
    results = [ops[job["op"]](job) for job in jobs]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
