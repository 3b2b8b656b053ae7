"""`kvabi prefill-worker`: a foreign engine (HF transformers or llama.cpp) as a prefill instance.

Its own process, serving the KV endpoint that `kvabi serve --role decode --kv-peer` fetches
from, with the same transport, shared-secret handshake and settings as `kvabi serve --role
prefill` (`--kv-secret` or $KVABI_KV_SECRET). It prints one line when it serves, and stops on
SIGTERM or Ctrl-C. The fingerprint is the one kvabi computes for the same model: the GGUF's
(`gguf_fingerprint`) whichever engine loads it; for an HF folder, the state dict's under the
names kvabi's loader gives (HF's, less the `model.` prefix). `--fingerprint` overrides it.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from typing import Any

ENGINES = ("hf", "llamacpp")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def add_prefill_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, choices=ENGINES, help="the engine that prefills")
    p.add_argument(
        "--model",
        help="a .gguf file, an HF folder (hf only), or a bundled name (default: bundled SmolLM2)",
    )
    p.add_argument("--fingerprint", help="the model fingerprint to declare (default: computed)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="hf: weights dtype")
    p.add_argument("--kv-layout", default="nhd", help="nhd, hnd or a paged preset name")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, help="compute threads (default: the engine's)")
    p.add_argument("--max-model-len", type=int, default=0, help="llamacpp: n_ctx (0: model's)")
    p.add_argument("--kv-address", default="127.0.0.1:8100", help="KV endpoint to bind")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "nixl"], help="how KV travels")
    p.add_argument("--kv-timeout", type=float, default=10.0, help="seconds a transfer may stall")
    p.add_argument(
        "--kv-secret",
        default=os.environ.get("KVABI_KV_SECRET"),
        help="shared secret of the deployment's KV endpoints (default: $KVABI_KV_SECRET)",
    )


def cmd_prefill_worker(args: argparse.Namespace) -> int:
    from kvabi.disagg.settings import DisaggSettings
    from kvabi.engine.engine import KV_LAYOUTS

    if not args.kv_secret:
        raise SystemExit("kvabi prefill-worker: set --kv-secret or $KVABI_KV_SECRET")
    settings = DisaggSettings(
        "prefill",
        args.kv_secret.encode(),
        kv_address=args.kv_address,
        transport=args.kv_transport,
        io_timeout_s=args.kv_timeout,
    )
    layout = KV_LAYOUTS.get(args.kv_layout, args.kv_layout)
    provider = (hf_provider if args.engine == "hf" else llamacpp_provider)(args, layout)
    server = settings.make_transport().listen(settings.kv_address, provider.desc, provider)
    print(f"kvabi prefill-worker: {args.engine} serving KV on {server.address}", flush=True)
    print(f"descriptor: {provider.desc}", flush=True)
    try:
        wait_for_stop()
    finally:
        server.close()
    return 0


def hf_provider(args: argparse.Namespace, layout: str) -> Any:
    """An HFPrefillProvider over `--model` loaded by transformers (a GGUF is dequantised)."""
    import torch
    import transformers

    from kvabi.interop.foreign_prefill import HFPrefillProvider
    from kvabi.interop.model_spec import gguf_fingerprint, state_dict_fingerprint
    from kvabi.models.registry import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    dtype = getattr(torch, DTYPES[args.dtype])
    if source.format == "gguf":
        folder, kw = source.path.parent, {"gguf_file": source.path.name}
    else:
        folder, kw = source.path, {}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw)
    fingerprint = args.fingerprint or (
        gguf_fingerprint(source.path)
        if source.format == "gguf"
        else state_dict_fingerprint(
            {name.removeprefix("model."): t for name, t in model.state_dict().items()}
        )
    )
    return HFPrefillProvider(model, fingerprint, args.block_size, layout)


def llamacpp_provider(args: argparse.Namespace, layout: str) -> Any:
    """A LlamaCppPrefillProvider over `--model` (a GGUF) loaded by llama-cpp-python."""
    import llama_cpp

    from kvabi.interop.foreign_prefill import LlamaCppPrefillProvider
    from kvabi.interop.model_spec import gguf_fingerprint
    from kvabi.models.registry import resolve_model

    source = resolve_model(args.model)
    if source.format != "gguf":
        raise ValueError(f"--engine llamacpp loads a .gguf file; {source.path} is an HF folder")
    kw = {"n_threads": args.threads} if args.threads else {}
    llm = llama_cpp.Llama(
        model_path=str(source.path), n_ctx=args.max_model_len, verbose=False, **kw
    )
    fingerprint = args.fingerprint or gguf_fingerprint(source.path)
    return LlamaCppPrefillProvider(llm, fingerprint, args.block_size, layout)


def wait_for_stop() -> None:
    """Block until SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
