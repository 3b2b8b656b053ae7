"""The `kvabi` command line: layouts, inspect, convert, plan, generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvabi.abi.errors import KvabiError
from kvabi.abi.presets import PRESETS
from kvabi.abi.table import print_table
from kvabi.cli.containers import add_container_commands
from kvabi.cli.disagg import add_disagg_args, add_router_args, cmd_disagg, cmd_router
from kvabi.cli.plan_cli import add_plan_args
from kvabi.cli.prefill_worker import add_prefill_worker_args, cmd_prefill_worker
from kvabi.cli.serve import add_serve_args, add_serve_bench_args, cmd_serve
from kvabi.engine.threads import fit_threads


def cmd_generate(args: argparse.Namespace) -> int:
    from kvabi.cli.generate import cmd_generate as run

    return run(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from kvabi.cli.generate import cmd_chat as run

    return run(args)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="a .gguf file, an HF folder, or a bundled name "
        "(default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="weights and KV; auto: bf16 where the CPU computes it natively (AVX-512 BF16, AMX)",
    )
    p.add_argument("--kv-layout", default="nhd", help="nhd, hnd or a paged preset name")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)


def cmd_layouts(args: argparse.Namespace) -> int:
    rows = [
        [
            p.name,
            p.kind,
            p.layout.axes + (f" / V {p.layout.v_axes}" if p.layout.v_axes else ""),
            p.layout.block_size or "-",
            p.layout.dtype,
            p.layout.quant,
            p.shape,
        ]
        for p in PRESETS.values()
        if args.kind in (None, p.kind)
    ]
    print_table(
        f"{len(rows)} presets (axes: L layer, K plane, B block, N slot, H head, "
        "C content, T token)",
        ["name", "kind", "axes", "bs", "dtype", "quant", "engine's tensor"],
        rows,
    )
    if args.sources:
        print()
        for p in PRESETS.values():
            print(f"{p.name}: {p.source}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "convert":
        from kvabi.bench.convert_bench import run

        run(args.quick, args.json)
    elif args.what == "throughput":
        from kvabi.bench.throughput import run as run_throughput

        run_throughput(args.quick, args.json, args.dtype, args.model)
    elif args.what == "serve":
        from kvabi.bench.serve_bench import run as run_serve

        run_serve(args)
    elif args.what == "prefix":
        from kvabi.bench.prefix_bench import run as run_prefix

        run_prefix(args.quick, args.json, args.prefix_plot, args.model)
    elif args.what == "memory":
        from kvabi.bench.memory_bench import run as run_memory

        run_memory(args.quick, args.json, args.model)
    elif args.what == "windows":
        from kvabi.bench.window_bench import run as run_windows

        run_windows(args.quick, args.json, args.model)
    elif args.what == "disagg":
        from kvabi.bench.disagg_bench import run as run_disagg

        run_disagg(args.quick, args.json)
    elif args.what == "vllm":
        from kvabi.bench.vllm_bench import run as run_vllm

        run_vllm(args.quick, args.json)
    elif args.what == "decode":
        from kvabi.bench.decode_bench import run as run_decode

        run_decode(args.quick, args.json)
    elif args.what == "mla":
        from kvabi.bench.mla_bench import run as run_mla

        run_mla(args.quick, args.json)
    elif args.what == "spec":
        from kvabi.bench.spec_bench import run as run_spec

        run_spec(args.quick, args.json)
    elif args.what == "tp":
        from kvabi.bench.tp_bench import run as run_tp

        run_tp(args.quick, args.json)
    elif args.what == "compress":
        from kvabi.bench.compress_bench import run as run_compress

        run_compress(args.quick, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvabi", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layouts", help="list the engine layout presets")
    p.add_argument("--kind", choices=["attn", "mla"])
    p.add_argument("--sources", action="store_true", help="print each preset's source")
    p.set_defaults(fn=cmd_layouts)
    add_container_commands(sub)
    add_plan_args(sub)
    p = sub.add_parser("generate", help="complete a prompt, streamed, with the kvabi engine")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action="store_true", help="wrap as one user chat turn")
    add_engine_args(p)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("chat", help="an interactive chat with the kvabi engine")
    add_engine_args(p)
    p.set_defaults(fn=cmd_chat)
    p = sub.add_parser("bench", help="benchmarks, as ratios against a same-run baseline")
    p.add_argument(
        "what",
        choices=[
            "convert",
            "throughput",
            "serve",
            "prefix",
            "memory",
            "windows",
            "disagg",
            "vllm",
            "decode",
            "mla",
            "spec",
            "tp",
            "compress",
        ],
    )

    p.add_argument(
        "--dtype",
        action="append",
        choices=["auto", "bf16", "fp32"],
        help="throughput: model dtypes to run (default auto: bf16 where the CPU computes it "
        "natively, else fp32); repeat for several",
    )
    p.add_argument("--quick", action="store_true", help="the ~1 minute size")
    p.add_argument("--json", help="write the figures as one JSON object to this file")
    p.add_argument(
        "--prefix-plot",
        default="out/bench/prefix_hit_rate.png",
        help="prefix: where to write the PNG of hit rate against pool capacity",
    )
    add_serve_bench_args(p)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("serve", help="the OpenAI-compatible server (completions, chat, metrics)")
    add_serve_args(p)
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("router", help="front door to prefill and decode instances (OpenAI API)")
    add_router_args(p)
    p.set_defaults(fn=cmd_router)
    p = sub.add_parser("disagg", help="a router, one prefill and one decode instance, here")
    add_disagg_args(p)
    p.set_defaults(fn=cmd_disagg)
    p = sub.add_parser("prefill-worker", help="HF or llama.cpp as a prefill KV endpoint")
    add_prefill_worker_args(p)
    p.set_defaults(fn=cmd_prefill_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fit_threads()  # torch's threads from the cores this process owns (engine/threads.py)
    try:
        return args.fn(args)
    except (KvabiError, KeyError, OSError, ValueError) as exc:
        print(f"kvabi {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
