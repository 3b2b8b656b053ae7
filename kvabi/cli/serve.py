"""`kvabi serve`: the OpenAI-compatible server on one model, in the foreground."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvabi.cache.tier_config import TierConfig


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="a .gguf file, an HF folder, or a bundled name (default: the bundled SmolLM2)",
    )
    p.add_argument("--served-model-name", help="the `model` clients send (default: from --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVABI_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/* (default: $KVABI_API_KEY)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="weights and KV; auto: bf16 where the CPU computes it natively (AVX-512 BF16, AMX)",
    )
    p.add_argument("--kv-layout", default="nhd", help="nhd, hnd or a paged preset name")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences batched together")
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: what 512 MiB holds)")
    p.add_argument(
        "--speculative",
        metavar="SPEC",
        help="speculative decoding: ngram:k=4,min=1,max=3 (prompt lookup), early-exit:k=3,exit=8 "
        "(the first 8 layers draft) or assistant:k=4 (a Gemma 4 assistant, --draft-model, "
        "reading the target's cache); greedy and sampled requests",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N processes over torch.distributed (gloo), each with its shard of the weights "
        "and KV heads (Llama-family models; a dead rank stops the engine: /health 503)",
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH",
        help="the drafter's HF folder for --speculative assistant:... (Gemma4AssistantForCausalLM)",
    )
    p.add_argument("--max-queued", type=int, default=256, help="requests waiting, then 503")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    p.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds a request's headers may take"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds its body may take (then 408)"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="/health answers 503 once the engine has work but computes nothing this long",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish block events in vLLM's KV-event format on this ZMQ endpoint "
        "(e.g. tcp://127.0.0.1:5557; off by default), for prefix-aware routers",
    )
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", help="ZMQ endpoint for replays")
    p.add_argument(
        "--kv-events-format",
        choices=["map", "array"],
        default="map",
        help="map: vLLM's named-field events (default); array: the positional form (older vLLM, "
        "llm-d's decoder)",
    )
    t = p.add_argument_group("KV tiers below the pool (prefix caching; none by default)")
    t.add_argument("--host-tier-bytes", type=int, default=0, help="host RAM tier capacity")
    t.add_argument("--disk-tier", metavar="DIR", help="local disk tier folder (survives restarts)")
    t.add_argument("--disk-tier-bytes", type=int, default=8 * 2**30)
    t.add_argument("--redis-tier", metavar="URL", help="a Redis shared by instances")
    t.add_argument("--redis-tier-bytes", type=int, default=2**30)
    g = p.add_argument_group("disaggregation (kvabi router sends requests to decode instances)")
    g.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    g.add_argument("--kv-address", default="127.0.0.1:8100", help="prefill: KV endpoint to bind")
    g.add_argument("--kv-peer", action="append", default=[], help="decode: a prefill KV endpoint")
    g.add_argument("--kv-transport", default="tcp", choices=["tcp", "nixl"], help="how KV travels")
    g.add_argument(
        "--kv-timeout",
        type=float,
        default=10.0,
        help="seconds a prefill peer may stay silent (no data, no heartbeat) before the decode "
        "instance gives up on it and prefills locally",
    )
    g.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=120.0,
        help="seconds a whole fetch may take (queueing, prefill, transfer)",
    )
    g.add_argument(
        "--kv-peer-cooldown",
        type=float,
        default=30.0,
        help="decode: after 3 failed fetches in a row, skip that peer this long (doubling)",
    )
    g.add_argument(
        "--kv-secret",
        default=os.environ.get("KVABI_KV_SECRET"),
        help="shared secret of the deployment's KV endpoints (default: $KVABI_KV_SECRET)",
    )


def disagg_settings(args: argparse.Namespace) -> object | None:
    """The instance's DisaggSettings, or None for a colocated (`--role both`) server."""
    from kvabi.disagg.settings import DisaggSettings

    if args.role == "both":
        return None
    if not args.kv_secret:
        raise SystemExit("kvabi serve --role: set --kv-secret or $KVABI_KV_SECRET")
    return DisaggSettings(
        args.role,
        args.kv_secret.encode(),
        kv_address=args.kv_address,
        peers=tuple(args.kv_peer),
        transport=args.kv_transport,
        io_timeout_s=args.kv_timeout,
        transfer_timeout_s=args.kv_transfer_timeout,
        peer_cooldown_s=args.kv_peer_cooldown,
    )


def tier_config(args: argparse.Namespace) -> TierConfig:
    """The TierConfig the tier flags describe."""
    from kvabi.cache.tier_config import TierConfig

    return TierConfig(
        host_bytes=args.host_tier_bytes,
        disk_dir=args.disk_tier,
        disk_bytes=args.disk_tier_bytes,
        redis_url=args.redis_tier,
        redis_bytes=args.redis_tier_bytes,
    )


def served_name(model: str | None) -> str:
    """The default `model` name: a bundled name as is, a file's stem, a folder's name."""
    from kvabi.models.registry import BUNDLED_MODELS, DEFAULT_MODEL  # torch: only when serving

    if model is None or model in BUNDLED_MODELS:
        return model or DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.is_file() else path.name


def banner(model: str, host: str, port: int, has_key: bool) -> str:
    """The URL and a curl line to paste, printed before the model loads."""
    url = f"http://{host}:{port}/v1"
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    )
    auth = ' -H "Authorization: Bearer $KVABI_API_KEY"' if has_key else ""
    return (
        f"kvabi serve: {model} at {url} (loading the model first; Ctrl-C stops it)\n"
        f"try: curl {url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvabi.engine.llm import LLM
    from kvabi.server.app import server_hooks
    from kvabi.server.launch import run_server
    from kvabi.server.settings import ServerSettings

    disagg = disagg_settings(args)
    settings = ServerSettings(
        model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        max_queued=args.max_queued,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        stall_timeout_s=args.stall_timeout,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_format=args.kv_events_format,
    )
    print(
        banner(settings.model_name, args.host, args.port, settings.api_key is not None), flush=True
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_layout=args.kv_layout,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        speculative=args.speculative,
        draft_model=args.draft_model,
        tensor_parallel_size=args.tensor_parallel_size,
        tiers=tier_config(args),
        hooks=server_hooks(settings, disagg, args.tensor_parallel_size or 1),
    )
    run_server(llm.engine, settings, args.host, args.port, args.log_level, disagg)
    return 0


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """`kvabi bench serve` options (the bench parser's own --quick, --json, --dtype apply too)."""
    g = p.add_argument_group("serve (kvabi bench serve)")
    g.add_argument("--rate", type=float, action="append", help="requests/s; repeat for several")
    g.add_argument("--base-url", help="an OpenAI endpoint (.../v1); default: start kvabi serve")
    g.add_argument(
        "--model",
        help="model to serve, or (with --base-url) the model to request; throughput and prefix: "
        "a bundled model's name (default smollm2-135m-instruct)",
    )
    g.add_argument("--api-key", default=os.environ.get("KVABI_API_KEY"))
    g.add_argument("--num-prompts", type=int, help="requests per rate")
    g.add_argument("--input-len", type=int, help="mean prompt words")
    g.add_argument("--output-len", type=int, help="mean max_tokens")
    g.add_argument("--prefix-len", type=int, default=0, help="words of shared prefix per prompt")
    g.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (a vLLM/kvabi extension) to get exact output lengths",
    )
    g.add_argument("--plot", default="out/bench/serve_latency.png", help="PNG of latency vs rate")
