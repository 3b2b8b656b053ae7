"""vLLM's side of the cache hand-offs: run a prompt in vLLM, export its KV, import kvabi's.

Runs inside vLLM's own interpreter (`scripts/setup_vllm.sh` makes `.venv-vllm`) with the repo
on PYTHONPATH; it imports kvabi's `abi`, `wire` and `interop` layers (torch, numpy, xxhash) and
vllm, never the engine. kvabi/connectors/vllm_handoff.py writes the job and reads the result:

    PYTHONPATH=. .venv-vllm/bin/python kvabi/connectors/vllm_kv_worker.py --job J.json --out R.json

Job: {"model_dir", "dtype" (bfloat16|float32), "model" (descriptor JSON of the model part),
"prompt_ids", "max_tokens", "export_path", "import_path" (a container of the prompt's KV from
another engine, or null)}. Steps, in one vLLM process with prefix caching on:
1. vLLM runs the prompt greedily; its block table is read while the request runs.
2. Export: the prompt's KV, read from vLLM's cache tensors through the `vllm-cpu-*` preset
   of the layers' ISA, is written as a container (tokens and ABI block hashes).
3. Import: the other engine's KV is converted into the prompt's cached full blocks, the prompt
   runs again (a prefix-cache hit: vLLM reads the imported blocks), then once more with those
   blocks zeroed (control: the output must change, so the blocks are really read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: its cache is reachable
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
}


def _start(job: dict[str, Any]) -> tuple[Any, Any]:
    os.environ.update(ENV)  # read when vllm is imported: set first
    import vllm

    llm = vllm.LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
    )
    return vllm, llm


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _run(vllm: Any, llm: Any, ids: list[int], max_tokens: int, tag: str) -> dict[str, Any]:
    """Greedy run of one prompt, stepping the engine; the block table is read while it runs
    (after each step: a chunked prefill grows it; it is freed in the step that finishes)."""
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine, scheduler = llm.llm_engine, _core(llm).scheduler
    engine.add_request(tag, {"prompt_token_ids": ids}, params)
    block_ids, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
        if scheduler.running:
            request_id = scheduler.running[0].request_id
            block_ids = list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])
    return {
        "tokens": list(final.outputs[0].token_ids),
        "block_ids": block_ids,
        "num_cached_tokens": final.num_cached_tokens,
    }


def _attention_layers(llm: Any) -> list[Any]:
    """vLLM's attention modules in layer order (each has `.kv_cache` and `.isa`)."""
    from vllm.model_executor.models.utils import extract_layer_index

    runner = _core(llm).model_executor.driver_worker.worker.model_runner
    context = runner.compilation_config.static_forward_context
    names = [n for n in context if hasattr(context[n], "isa")]
    return [context[n] for n in sorted(names, key=extract_layer_index)]


def _cache(llm: Any, model: Any) -> Any:
    from kvabi.interop.vllm_cache import kv_caches_to_buffers

    layers = _attention_layers(llm)
    isas = {layer.isa for layer in layers}
    if len(isas) != 1:
        raise RuntimeError(f"layers use several ISAs {isas}; one preset per cache")
    return kv_caches_to_buffers([layer.kv_cache for layer in layers], model, isas.pop())


def _export(cache: Any, ids: list[int], block_ids: list[int], path: str) -> int:
    from kvabi.cache.block_hasher import BlockHasher
    from kvabi.interop.vllm_cache import read_sequence
    from kvabi.wire import write_container

    seq = read_sequence(cache, block_ids, len(ids))
    hashes = BlockHasher(seq.desc.model.compat_digest(), cache.desc.layout.block_size).hashes(ids)
    return write_container(path, seq, ids, hashes)


def _import(vllm: Any, llm: Any, cache: Any, job: dict[str, Any], own: dict) -> dict[str, Any]:
    """The other engine's KV into the prompt's full cached blocks; then the prompt again."""
    import torch

    from kvabi.interop.vllm_cache import write_sequence
    from kvabi.wire import read_container

    ids, bs = job["prompt_ids"], cache.desc.layout.block_size
    num_full = (len(ids) - 1) // bs  # vLLM caches full blocks, and recomputes the last token
    blocks = own["block_ids"][:num_full]
    src = read_container(job["import_path"], expect=cache.desc.model).cache
    write_sequence(src, cache, blocks, num_full * bs)
    imported = _run(vllm, llm, ids, job["max_tokens"], "imported")
    for tensor in cache.tensors.values():
        tensor[torch.tensor(blocks)] = 0
    zeroed = _run(vllm, llm, ids, job["max_tokens"], "zeroed")
    return {"imported": imported, "zeroed": zeroed, "imported_blocks": blocks}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from kvabi.abi.descriptor import Descriptor

    start = time.perf_counter()
    vllm, llm = _start(job)
    result: dict[str, Any] = {"vllm": vllm.__version__, "startup_s": time.perf_counter() - start}
    model = Descriptor.from_json(job["model"]).model
    ids = job["prompt_ids"]
    own = _run(vllm, llm, ids, job["max_tokens"], "own")
    cache = _cache(llm, model)
    result |= {"own": own, "descriptor": str(cache.desc)}
    result["export_bytes"] = _export(cache, ids, own["block_ids"], job["export_path"])
    if job.get("import_path"):
        result |= _import(vllm, llm, cache, job, own)
    result["wall_s"] = time.perf_counter() - start
    return result


def job_main(run_job: Any, description: str, argv: list[str] | None = None) -> int:
    """`--job J --out R`: run the JSON job in J, write the JSON result to R (both workers)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--job", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    result = run_job(json.loads(args.job.read_text(encoding="utf-8")))
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    return job_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
