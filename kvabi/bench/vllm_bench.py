"""`kvabi bench vllm`: vLLM alone against vLLM with kvabi's KV connector, in one run.

Workload: `num_docs` long documents, each followed by a question (the shared-prefix case a KV
store exists for). A first vLLM instance ("warm", with the connector) has seen every document
with another question, so the store (a disk tier, entries in kvabi's engine layout) holds
them. Two fresh vLLM instances then answer the new questions, one request at a time: "alone"
(no connector) and "kvabi" (the connector over the same store). vLLM's own prefix cache is on
in both (its default), but a fresh process cannot hold the documents yet: the case of a
restarted or scaled-out instance. Afterwards "alone" also runs the warm-up questions and then
the measured ones again, now hitting its own prefix cache: the same reuse of the same KV
(computed by the same vLLM on the same tokens), so kvabi's greedy tokens must equal those
exactly. Against the cold recompute, tokens may part at a near-tie (bf16 GEMMs round a
document's KV slightly differently when the prompt around it differs); the count is printed.

Figures: TTFT (vLLM's per-request first-token latency), median of each and the ratio
alone/kvabi; prefill tokens saved (tokens vLLM reports cached / prompt tokens); the
connector's cost per store block: fetch (read the entry from the disk tier and verify it:
checksums, model, hash, tokens; scheduler side), load (convert 16-token NHD blocks into vLLM's
128-token `vllm-cpu-*` blocks; worker side) and save (convert out of vLLM's blocks, encode),
each as bytes/s against a plain memory copy of the same bytes in this process.

    kvabi bench vllm [--quick] [--json FILE]     (needs .venv-vllm: scripts/setup_vllm.sh)
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvabi.abi.buffers import buffer_specs
from kvabi.abi.table import print_table
from kvabi.bench.report import best_seconds, is_disturbed, machine, plain_copy_gbps, write_json
from kvabi.bench.serve_load import WORDS
from kvabi.connectors.vllm_handoff import VLLM_PYTHON, Handoff, prepare, run_connector_worker
from kvabi.native.cpu_kernels import cpu_kernels, kernel_status


@dataclass(frozen=True)
class Sizes:
    num_docs: int
    doc_words: int
    max_tokens: int = 8


QUICK = Sizes(num_docs=4, doc_words=700)
# the baseline copies as many bytes as the quick run loads in all (59 MB: past the L3 cache,
# as the connector's bytes are, which the forwards between requests evict)
MEMCPY_BLOCKS = 160
FULL = Sizes(num_docs=8, doc_words=1100)


def run(quick: bool, json_path: str | None) -> dict:
    if not VLLM_PYTHON.exists():
        print("vLLM is not installed: run scripts/setup_vllm.sh", file=sys.stderr)
        raise SystemExit(1)
    sizes = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="kvabi-bench-vllm-") as tmp:
        out = Path(tmp)
        h = prepare(out, "bf16")
        h = Handoff(h.loaded, h.fingerprint, h.prompt_ids, out, max_tokens=sizes.max_tokens)
        figures = _measure(h, sizes, out / "store")
    _print(figures)
    write_json(json_path, figures)
    return figures


def _workload(h: Handoff, sizes: Sizes) -> tuple[list[dict], list[dict]]:
    """Each document with a first question (the warm-up) and a second one (measured)."""
    rng = random.Random(0)
    encode = h.loaded.tokenizer.encode
    warm, measured = [], []
    for i in range(sizes.num_docs):
        doc = encode(" ".join(rng.choice(WORDS) for _ in range(sizes.doc_words)))
        for prompts, question in ((warm, "Summarise it."), (measured, f"Name word {i + 3}.")):
            prompts.append({"ids": doc + encode(f"\nQuestion: {question}\nAnswer:")})
    return warm, measured


def _measure(h: Handoff, sizes: Sizes, store: Path) -> dict:
    warm, measured = _workload(h, sizes)
    disk = {"disk_dir": str(store)}
    block_bytes = sum(spec.num_bytes for spec in buffer_specs(h.descriptor(), 1))
    memcpy: list[float] = []  # the baseline, before and after each vLLM run

    def sample_memcpy() -> None:
        memcpy.append(_memcpy_bytes_per_s(MEMCPY_BLOCKS * block_bytes))

    sample_memcpy()
    saved = run_connector_worker(h, "bf16", warm, "warm", **disk)
    sample_memcpy()
    again = measured + warm + measured  # cold, then its own prefix cache's hits
    alone = run_connector_worker(h, "bf16", again, "alone", connector=False, prefix_caching=True)
    sample_memcpy()
    cold, hits = alone["runs"][: len(measured)], alone["runs"][-len(measured) :]
    kvabi = run_connector_worker(h, "bf16", measured, "kvabi", prefix_caching=True, **disk)
    sample_memcpy()
    prompt_tokens = sum(len(p["ids"]) for p in measured)
    ttft_alone = statistics.median(r["ttft_s"] for r in cold)
    ttft_kvabi = statistics.median(r["ttft_s"] for r in kvabi["runs"])
    ttft_hit = statistics.median(r["ttft_s"] for r in hits)
    tokens = [r["tokens"] for r in kvabi["runs"]]
    load, save = kvabi["transfer"], saved["transfer"]
    memcpy_bps = statistics.median(memcpy)
    disturbed = is_disturbed(min(memcpy) / 1e9, plain_copy_gbps())
    load_bps = load["bytes_loaded"] / load["load_s"]
    fetch_bps = block_bytes * load["num_fetched"] / load["fetch_s"]
    save_bps = save["bytes_saved"] / save["save_s"]
    ratio = (lambda bps: None) if disturbed else (lambda bps: bps / memcpy_bps)
    return {
        "num_requests": len(measured),
        "prompt_tokens": prompt_tokens,
        "ttft_alone_ms": ttft_alone * 1e3,
        "ttft_kvabi_ms": ttft_kvabi * 1e3,
        "ttft_vllm_prefix_hit_ms": ttft_hit * 1e3,
        "ttft_ratio": ttft_alone / ttft_kvabi,
        "ttft_vs_own_prefix_hit_ratio": ttft_hit / ttft_kvabi,
        "cached_tokens_alone": sum(r["num_cached_tokens"] for r in cold),
        "cached_tokens_prefix_hit": sum(r["num_cached_tokens"] for r in hits),
        "cached_tokens_kvabi": sum(r["num_cached_tokens"] for r in kvabi["runs"]),
        "prefill_saved_fraction": sum(r["num_cached_tokens"] for r in kvabi["runs"])
        / prompt_tokens,
        "same_tokens_as_prefix_hit": tokens == [r["tokens"] for r in hits],
        "num_same_as_cold": sum(t == r["tokens"] for t, r in zip(tokens, cold, strict=True)),
        "block_bytes": block_bytes,
        "blocks_loaded": load["num_loaded"],
        "blocks_saved": save["num_saved"],
        "load_us_per_block": load["load_s"] / max(load["num_loaded"], 1) * 1e6,
        "fetch_us_per_block": load["fetch_s"] / max(load["num_fetched"], 1) * 1e6,
        "fetch_gbps": fetch_bps / 1e9,
        "fetch_vs_memcpy_ratio": ratio(fetch_bps),
        "save_us_per_block": save["save_s"] / max(save["num_saved"], 1) * 1e6,
        "memcpy_gbps": memcpy_bps / 1e9,
        "load_gbps": load_bps / 1e9,
        "save_gbps": save_bps / 1e9,
        "load_vs_memcpy_ratio": ratio(load_bps),
        "save_vs_memcpy_ratio": ratio(save_bps),
        "memcpy_spread": max(memcpy) / min(memcpy),
        "memcpy_disturbed": disturbed,
        "ran_on": _ran_on(),
        "store_bytes": sum(p.stat().st_size for p in store.rglob("*.kvabi")),
    }


def _ran_on() -> dict:
    """The machine, and which kernel paths the connector's conversions took."""
    kernels = cpu_kernels()
    return machine() | {
        "kernels": kernel_status(),
        "transposes": "AVX-512 tiles" if kernels and kernels.transposes_fast else "torch",
    }


def _memcpy_bytes_per_s(num_bytes: int) -> float:
    """A plain copy of `num_bytes` (one tensor to another), best of 5."""
    src = torch.ones(max(num_bytes, 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return src.numel() / best_seconds(lambda: dst.copy_(src), repeats=5)


def _print(f: dict) -> None:
    print_table(
        f"vLLM with kvabi's connector: {f['num_requests']} requests on documents another "
        "instance saw (fresh processes, one request at a time)",
        ["", "vLLM alone", "vLLM + kvabi", "ratio", "vLLM, own prefix hit"],
        [
            [
                "TTFT median (ms)",
                f["ttft_alone_ms"],
                f["ttft_kvabi_ms"],
                f["ttft_ratio"],
                f["ttft_vllm_prefix_hit_ms"],
            ],
            [
                "cached prompt tokens",
                f["cached_tokens_alone"],
                f["cached_tokens_kvabi"],
                "",
                f["cached_tokens_prefix_hit"],
            ],
            ["prefill saved", "", f"{f['prefill_saved_fraction']:.1%}", "", ""],
            [
                "greedy tokens equal",
                f"{f['num_same_as_cold']}/{f['num_requests']} cold",
                "",
                "",
                str(f["same_tokens_as_prefix_hit"]),
            ],
        ],
    )
    print_table(
        f"connector cost per store block ({f['block_bytes']} B of K/V, 16 tokens)",
        ["", "us/block", "GB/s", "vs memcpy"],
        [
            [
                "fetch (disk read + verify)",
                f["fetch_us_per_block"],
                f["fetch_gbps"],
                f["fetch_vs_memcpy_ratio"],
            ],
            [
                "load (convert into vLLM's)",
                f["load_us_per_block"],
                f["load_gbps"],
                f["load_vs_memcpy_ratio"],
            ],
            [
                "save (convert out, encode)",
                f["save_us_per_block"],
                f["save_gbps"],
                f["save_vs_memcpy_ratio"],
            ],
            ["memcpy (median of 4, between the runs)", "", f["memcpy_gbps"], 1.0],
        ],
    )
    print(f"memcpy spread {f['memcpy_spread']:.2f}" + (
        " (disturbed: another process held a core; no ratios)" if f["memcpy_disturbed"] else ""
    ))  # fmt: skip
    print_table("ran on", ["what", "value"], list(f["ran_on"].items()))
