"""vLLM's side of the cache hand-offs: run a prompt in vLLM, export its KV, import kvabi's.

Runs inside vLLM's own interpreter (`scripts/setup_vllm.sh` makes `.venv-vllm`) with the repo
on PYTHONPATH; it imports kvabi's `abi`, `wire` and `interop` layers (torch, numpy, xxhash) and
vllm, never the engine. kvabi/connectors/vllm_handoff.py writes the job and reads the result:

    PYTHONPATH=. .venv-vllm/bin/python kvabi/connectors/vllm_kv_worker.py --job J.json --out R.json

Job: {"model_dir", "dtype" (bfloat16|float32), "model" (descriptor JSON of the model part),
"prompt_ids", "max_tokens", "export_path", "export_tokens" (how many of the prompt's tokens
to export; default all), "import_path" (a container of the prompt's KV from
another engine, or null)}. Steps, in one vLLM process with prefix caching on:
1. vLLM runs the prompt greedily; its block tables (one per KV cache group: a hybrid model
   such as Gemma 3 has sliding and full groups) are read while the request runs.
2. Export, once the prompt is computed: its KV, read from vLLM's cache tensors through the
   `vllm-cpu-*` preset of the layers' ISA, each layer through its group's table, is written as
   a container (tokens and ABI block hashes; sliding layers carry their window's tail).
3. Import: the other engine's KV is converted into the blocks the prompt's cached full blocks
   need (a sliding layer: its window's), the prompt runs again (a prefix-cache hit: vLLM reads
   the imported blocks), then once more with those blocks zeroed (control: the output must
   change, so the blocks are really read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvabi.interop.vllm_cache import NULL_BLOCK  # torch only: vllm is imported later, in _start

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


def _run(
    vllm: Any, llm: Any, ids: list[int], max_tokens: int, tag: str,
    on_prefilled: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Greedy run of one prompt, stepping the engine. Its block tables, one per KV cache group,
    are read after every step (a chunked prefill grows them, a sliding group's turns blocks its
    window left into the null block, the finishing step frees them); `group_block_ids` keeps, per
    group and block index, the block the request held there. `on_prefilled` runs once, after
    the step that computed the whole prompt (its KV is all in the cache then)."""
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine, scheduler = llm.llm_engine, _core(llm).scheduler
    engine.add_request(tag, {"prompt_token_ids": ids}, params)
    tables: list[list[int]] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
        if scheduler.running:
            request = scheduler.running[0]
            now = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            tables = [_held(old, new) for old, new in zip_longest(tables, now, fillvalue=())]
            if on_prefilled is not None and request.num_computed_tokens >= len(ids):
                on_prefilled(tables)
                on_prefilled = None
    return {
        "tokens": list(final.outputs[0].token_ids),
        "block_ids": tables[0],
        "group_block_ids": tables,
        "num_cached_tokens": final.num_cached_tokens,
    }


def _held(seen: Sequence[int], now: Sequence[int]) -> list[int]:
    """A table's blocks so far: the null block where one was freed keeps the block it was."""
    longer = list(now) + list(seen[len(now) :])
    return [n if n != NULL_BLOCK or i >= len(seen) else seen[i] for i, n in enumerate(longer)]


def _attention_layers(llm: Any) -> list[Any]:
    """vLLM's attention modules in layer order (each has `.kv_cache` and `.isa`)."""
    from vllm.model_executor.models.utils import extract_layer_index

    runner = _core(llm).model_executor.driver_worker.worker.model_runner
    context = runner.compilation_config.static_forward_context
    names = [n for n in context if hasattr(context[n], "isa")]
    return [context[n] for n in sorted(names, key=extract_layer_index)]


def _layer_groups(llm: Any) -> list[int]:
    """Each layer's KV cache group (one group for a uniform model; Gemma 3: five sliding groups
    and one full group of 3 layers each)."""
    from vllm.model_executor.models.utils import extract_layer_index

    groups = _core(llm).scheduler.kv_cache_config.kv_cache_groups
    of = {extract_layer_index(n): g for g, group in enumerate(groups) for n in group.layer_names}
    return [of[i] for i in range(len(of))]


def _cache(llm: Any, model: Any) -> Any:
    from kvabi.interop.vllm_cache import kv_caches_to_buffers

    layers = _attention_layers(llm)
    isas = {layer.isa for layer in layers}
    if len(isas) != 1:
        raise RuntimeError(f"layers use several ISAs {isas}; one preset per cache")
    return kv_caches_to_buffers([layer.kv_cache for layer in layers], model, isas.pop())


def _per_layer(groups: list[int], tables: list[list[int]]) -> list[list[int]]:
    return [tables[g] for g in groups]


def _export(cache: Any, groups: list[int], ids: list[int], tables: list, path: str) -> int:
    """The prompt's KV (each layer's blocks from its group's table) as a container: a sliding
    layer carries its window's tail only (docs/ABI.md 5.7)."""
    from kvabi.cache.block_hasher import BlockHasher
    from kvabi.interop.vllm_cache import read_group_sequence
    from kvabi.wire import write_container

    seq = read_group_sequence(cache, _per_layer(groups, tables), len(ids))
    hashes = BlockHasher(seq.desc.model.compat_digest(), cache.desc.layout.block_size).hashes(ids)
    return write_container(path, seq, ids, hashes)


def _import(
    vllm: Any, llm: Any, cache: Any, groups: list[int], job: dict[str, Any], own: dict
) -> dict[str, Any]:
    """The other engine's KV into the blocks the prompt's cached prefix (its full blocks) needs,
    per layer through its group's table; then the prompt again, and once more with those blocks
    zeroed."""
    import torch

    from kvabi.interop.vllm_cache import needed_blocks, write_group_sequence
    from kvabi.wire import read_container

    ids, bs = job["prompt_ids"], cache.desc.layout.block_size
    num_cached = (len(ids) - 1) // bs * bs  # vLLM caches full blocks, recomputes the last token
    tables = _per_layer(groups, own["group_block_ids"])
    src = read_container(job["import_path"], expect=cache.desc.model).cache
    write_group_sequence(src, cache, tables, num_cached)
    imported = _run(vllm, llm, ids, job["max_tokens"], "imported")
    written = {
        layer: [tables[layer][j] for j in needed_blocks(spec.window, num_cached, bs)]
        for layer, spec in enumerate(cache.desc.model.layers)
    }
    for layer, blocks in written.items():
        cache.tensors[str(layer)][torch.tensor(blocks, dtype=torch.long)] = 0
    zeroed = _run(vllm, llm, ids, job["max_tokens"], "zeroed")
    return {"imported": imported, "zeroed": zeroed, "imported_blocks": written}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from kvabi.abi.descriptor import Descriptor

    start = time.perf_counter()
    vllm, llm = _start(job)
    result: dict[str, Any] = {"vllm": vllm.__version__, "startup_s": time.perf_counter() - start}
    model = Descriptor.from_json(job["model"]).model
    ids, cache, groups = job["prompt_ids"], _cache(llm, model), _layer_groups(llm)

    def export(tables: list[list[int]]) -> None:
        handed = ids[: job.get("export_tokens", len(ids))]
        result["export_bytes"] = _export(cache, groups, handed, tables, job["export_path"])

    own = _run(vllm, llm, ids, job["max_tokens"], "own", on_prefilled=export)
    result |= {"own": own, "descriptor": str(cache.desc), "layer_groups": groups}
    if job.get("import_path"):
        result |= _import(vllm, llm, cache, groups, job, own)
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
