"""One engine's side of `kvabi bench throughput`, run in its own process (for a clean peak RSS).

`python -m kvabi.bench.throughput_workers --engine kvabi|hf|llamacpp --model NAME --workload W
--out O`: NAME a bundled model; HF and llama.cpp load its GGUF. With `--serve-batch1` instead
of `--out` it stays up and runs the batch-1 request on each "batch1" line (paired runs).
Every engine gets the same token ids, greedy, EOS ignored, so each produces exactly the
requested number of tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


Generate = Callable[[list[tuple[list[int], int]]], list]


def build_kvabi(work: dict, dtype: str, model: str) -> tuple[Generate, dict]:
    from kvabi.engine.llm import LLM
    from kvabi.engine.outputs import OutputAccumulator
    from kvabi.engine.sampling_params import SamplingParams

    # Prefix caching off, as for vLLM (vllm_worker.py): the warm-up runs the same prompts, and
    # hits on them would measure the cache, not the engine (`kvabi bench prefix` measures that).
    llm = LLM(
        model, dtype=dtype, progress=False, max_num_batched_tokens=1024, enable_prefix_caching=False
    )
    engine = llm.engine

    def generate(requests: list[tuple[list[int], int]]) -> list[tuple[int, ...]]:
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in requests
        ]
        done, outputs = {}, OutputAccumulator()
        while engine.has_unfinished():
            done |= {o.request_id: o.outputs[0].token_ids for o in outputs.add(engine.step())}
        return [done[i] for i in ids]

    from kvabi.bench.decode_bench import _ran_on

    return generate, {"ran_on": _ran_on(llm)}


def build_hf(work: dict, dtype: str, model: str) -> tuple[Generate, dict]:
    import transformers

    from kvabi.models.registry import bundled_model_path

    path = bundled_model_path(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
    ).eval()

    @torch.inference_mode()
    def generate(requests: list[tuple[list[int], int]]) -> list[tuple[int, ...]]:
        # Static batching: left-pad to the longest prompt; every row runs to the longest output.
        width, new = max(len(p) for p, _ in requests), max(n for _, n in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(requests):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        return [tuple(out[i, width : width + n].tolist()) for i, (_, n) in enumerate(requests)]

    cpu_path = f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"
    return generate, {"cpu_path": cpu_path}


def build_llamacpp(
    work: dict, dtype: str, model: str, gguf: str | None = None
) -> tuple[Generate, dict]:
    """llama.cpp on `gguf` (default: the bundled file as shipped); `dtype` is not used."""
    import llama_cpp

    from kvabi.models.registry import bundled_model_path

    llm = llama_cpp.Llama(
        model_path=gguf or str(bundled_model_path(model)),
        n_ctx=2048,
        n_batch=512,
        n_threads=2,
        flash_attn=True,
        verbose=False,
    )
    eos = llm.token_eos()

    def no_eos(_ids: object, logits: object) -> object:
        logits[eos] = -float("inf")
        return logits

    def one(prompt: list[int], n: int) -> tuple[int, ...]:
        llm.reset()
        out = []
        for token in llm.generate(
            prompt,
            temp=0.0,
            top_k=1,
            reset=True,
            logits_processor=llama_cpp.LogitsProcessorList([no_eos]),
        ):
            out.append(token)
            if len(out) == n:
                break
        return tuple(out)

    # llama-cpp-python serves one sequence at a time: concurrent requests run in turn.
    cpu_path = llama_cpp.llama_print_system_info().decode()
    return (lambda reqs: [one(p, n) for p, n in reqs]), {"cpu_path": cpu_path}


def _warm_up(generate: Generate, work: dict) -> None:
    """Every engine runs the whole workload once untimed, so one-off costs (kernel JIT per shape
    in oneDNN, allocator growth) stay out of the figures for all alike."""
    b1 = work["batch1"]
    generate([(b1["prompt_ids"], b1["max_tokens"])])
    generate([(r["prompt_ids"], r["max_tokens"]) for r in work["concurrent"]])


def _batch1(generate: Generate, b1: dict) -> dict:
    """The batch-1 request's TTFT and decode tokens/s. TTFT is ~0.1 s: the median of 5 runs, so
    one descheduled moment on a shared machine does not decide the figure (the same for every
    engine); the whole request likewise, the median of 3 (decode = the time past the TTFT)."""
    ttft = statistics.median(_timed(lambda: generate([(b1["prompt_ids"], 1)]))[0] for _ in range(5))
    runs = [_timed(lambda: generate([(b1["prompt_ids"], b1["max_tokens"])])) for _ in range(3)]
    total = statistics.median(t for t, _ in runs)
    return {
        "batch1_ttft_s": ttft,
        "batch1_decode_tok_s": (b1["max_tokens"] - 1) / (total - ttft),
        "batch1_tokens": list(runs[0][1][0]),
    }


def _measure(generate: Generate, work: dict) -> dict:
    reqs = [(r["prompt_ids"], r["max_tokens"]) for r in work["concurrent"]]
    _warm_up(generate, work)
    figures = _batch1(generate, work["batch1"])
    wall, outs = _timed(lambda: generate(reqs))
    produced = sum(len(o) for o in outs)
    return figures | {
        "concurrent_tok_s": produced / wall,
        "concurrent_wall_s": wall,
        "concurrent_tokens": produced,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def serve_batch1(generate: Generate, work: dict) -> None:
    """Paired runs (`throughput.paired_batch1`): warm up, say "ready", then for each
    "batch1" line on stdin print the batch-1 figures as one JSON line; stop at EOF."""
    _warm_up(generate, work)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "batch1":
            print(json.dumps(_batch1(generate, work["batch1"])), flush=True)


BUILDERS = {"kvabi": build_kvabi, "hf": build_hf, "llamacpp": build_llamacpp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=sorted(BUILDERS), required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", help="where the figures go (not with --serve-batch1)")
    parser.add_argument(
        "--serve-batch1", action="store_true", help="answer 'batch1' lines on stdin (paired runs)"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a bundled model")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--gguf", help="llamacpp: the GGUF to load (default the bundled one)")
    args = parser.parse_args()
    if not (args.out or args.serve_batch1):
        parser.error("--out is required (except with --serve-batch1)")
    work = json.loads(Path(args.workload).read_text())
    extra = {"gguf": args.gguf} if args.engine == "llamacpp" else {}
    generate, info = BUILDERS[args.engine](work, args.dtype, args.model, **extra)
    if args.serve_batch1:
        serve_batch1(generate, work)
        return
    figures = _measure(generate, work) | info | {"engine": args.engine}
    figures |= {"gguf": Path(args.gguf).name} if args.gguf else {"dtype": args.dtype}
    Path(args.out).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
