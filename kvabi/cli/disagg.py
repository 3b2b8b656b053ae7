"""`kvabi router` (the disaggregated front door) and `kvabi disagg` (router + one prefill and one
decode instance on this machine, in one command)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

from kvabi.abi.hash_schemes import SCHEMES


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--prefill",
        nargs=2,
        action="append",
        default=[],
        metavar=("URL", "KV_ADDRESS"),
        help="a prefill instance: its server URL and its KV endpoint (repeatable)",
    )
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="(repeatable)")
    p.add_argument(
        "--kv-events",
        nargs=2,
        action="append",
        default=[],
        metavar=("URL", "ENDPOINT"),
        help="route by cached prefix: instance URL (a --decode or --prefill one) publishes its "
        "KV events on ZMQ ENDPOINT (its `kvabi serve --kv-events`; repeatable)",
    )
    p.add_argument(
        "--hash-scheme",
        default="kvabi",
        choices=sorted(SCHEMES),
        help="the block-hash scheme of the --kv-events instances' events (docs/ABI.md 4.3): "
        "kvabi, or a vLLM / llm-d / SGLang deployment's",
    )
    p.add_argument(
        "--hash-seed",
        default=None,
        help="the peer's hash seed (vLLM: its PYTHONHASHSEED; llm-d: hashSeed); "
        "default: the scheme's",
    )
    p.add_argument(
        "--hash-model", default="", help="the model name llm-d-fnv64a roots on (llm-d's)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvabi.routing.prefix_routing import EventSource
    from kvabi.routing.prompt_hashing import PromptHashing
    from kvabi.routing.router import PrefillTarget, RouterConfig, create_router_app
    from kvabi.server.http_limits import (
        BodyDeadline,
        BodyTimeout,
        body_timeout_response,
        header_deadline_protocol,
    )
    from kvabi.server.settings import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

    config = RouterConfig(
        tuple(PrefillTarget(url, kv) for url, kv in args.prefill),
        tuple(args.decode),
        kv_events=tuple(EventSource(url, endpoint) for url, endpoint in args.kv_events),
        hashing=PromptHashing(args.hash_scheme, args.hash_seed, args.hash_model),
    )
    print(f"kvabi router: http://{args.host}:{args.port}/v1 -> {config}", flush=True)
    app = create_router_app(config)
    app.add_middleware(BodyDeadline, timeout_s=BODY_TIMEOUT_S)
    app.add_exception_handler(BodyTimeout, body_timeout_response)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=header_deadline_protocol(HEADER_TIMEOUT_S),
    )
    return 0


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    add_router_args(p)
    p.add_argument("--model", help="a .gguf file, an HF folder, or a bundled name")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="weights and KV; auto: bf16 where the CPU computes it natively (AVX-512 BF16, AMX)",
    )
    p.add_argument("--prefill-layout", default="hnd", help="the prefill instance's KV layout")
    p.add_argument("--prefill-block-size", type=int, default=16)
    p.add_argument("--decode-layout", default="nhd", help="the decode instance's KV layout")
    p.add_argument("--decode-block-size", type=int, default=32)


def instance_args(args: argparse.Namespace, role: str, kv_address: str) -> list[str]:
    """`kvabi serve` arguments of one instance of `kvabi disagg`."""
    layout = args.prefill_layout if role == "prefill" else args.decode_layout
    bs = args.prefill_block_size if role == "prefill" else args.decode_block_size
    out = ["--role", role, "--dtype", args.dtype, "--kv-layout", layout, "--block-size", str(bs)]
    out += ["--kv-address" if role == "prefill" else "--kv-peer", kv_address]
    return out + (["--model", args.model] if args.model else [])


def cmd_disagg(args: argparse.Namespace) -> int:
    from kvabi.server.launch import ServerProcess

    env = {"KVABI_KV_SECRET": os.environ.get("KVABI_KV_SECRET") or secrets.token_hex(32)}
    prefill, decode = ServerProcess(env=env), ServerProcess(env=env)
    decode.port = _other_port({prefill.port, args.port})  # the OS may hand a port out twice
    kv_address = f"127.0.0.1:{_other_port({prefill.port, decode.port, args.port})}"
    prefill.args = instance_args(args, "prefill", kv_address)
    decode.args = instance_args(args, "decode", kv_address)
    # uvicorn re-raises SIGTERM after its graceful shutdown: make that reach the `finally`, so
    # the instances are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        prefill.start(), decode.start()  # both load at once
        prefill.wait_ready(), decode.wait_ready()
        print(f"prefill {prefill.url} (KV {kv_address}), decode {decode.url}", flush=True)
        args.prefill, args.decode = [[prefill.url, kv_address]], [decode.url]
        return cmd_router(args)
    finally:
        prefill.stop(), decode.stop()


def _other_port(taken: set[int]) -> int:
    from kvabi.server.launch import free_port

    port = free_port()
    while port in taken:
        port = free_port()
    return port
