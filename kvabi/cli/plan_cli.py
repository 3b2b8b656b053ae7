"""`kvabi plan [MODEL]`: a model's KV groups, its KV memory at a context and concurrency, and
which of kvabi's attention paths each group gets on this machine.

MODEL is a catalog name (`kvabi/abi/catalog.py`), a bundled name, a .gguf file or an HF folder
(read for its config only: no weights are loaded). The paths come from the engine's own
dispatch predicates (`kvabi/engine/attention_plan.py`); the seeds' anti-pattern this answers is
adopting a model without checking that its attention gets the fast kernel.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from kvabi.abi.catalog import MODEL_NAMES, catalog_model, catalog_query_heads
from kvabi.abi.descriptor import ATTN, CENTRIES, MLA, Descriptor, LayerSpec, ModelSpec
from kvabi.abi.errors import KvabiError
from kvabi.abi.plan import group_memory, plan
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.abi.table import print_table
from kvabi.abi.text_form import from_text

DEFAULT_PLAN_LAYOUTS = {ATTN: "vllm-flash-attn", MLA: "vllm-mla"}  # by the model's layer kind
DEFAULT_MODEL = "llama-3-70b"


@dataclass(frozen=True)
class PlannedModel:
    """What `plan` needs of a model: its KV layers, each layer's query heads, its family."""

    spec: ModelSpec
    query_heads: tuple[int, ...]
    is_llama: bool  # kvabi's Llama-family model class (the fused decode's)
    source: str


def add_plan_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="KV groups, bytes per token, request and fleet; kernel paths")
    names = ", ".join(MODEL_NAMES)
    where = f"a bundled name, a .gguf file or an HF folder (default {DEFAULT_MODEL})"
    p.add_argument("model", nargs="?", help=f"a catalog name ({names}), {where}")
    p.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as an option")
    p.add_argument(
        "--layout",
        choices=sorted(PRESETS),
        metavar="PRESET",
        help="default: vllm-flash-attn for attention models, vllm-mla for MLA models",
    )
    p.add_argument("--dtype", help="default: the preset's (bf16, or u8 for fp8 records)")
    p.add_argument("--block-size", type=int, help="default: the preset's")
    p.add_argument("--descriptor", help="a descriptor's text form instead of model + layout")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument(
        "--tp", type=int, default=1, metavar="N", help="the tensor-parallel plan over N ranks"
    )
    p.set_defaults(fn=cmd_plan)


def planned_model(name: str) -> PlannedModel:
    """A catalog name, else whatever `kvabi generate --model` takes (config only)."""
    if name.lower() in MODEL_NAMES:
        spec = catalog_model(name)
        heads = (catalog_query_heads(name),) * len(spec.layers)
        return PlannedModel(spec, heads, spec.layers[0].kind == ATTN, "catalog")
    from kvabi.models.config import ModelConfig
    from kvabi.models.registry import query_heads, read_model_config, resolve_model

    source = resolve_model(name)
    config = read_model_config(name)
    spec = ModelSpec(config.kv_layers(), fingerprint=Path(name).name)
    kind = "HF folder" if source.format == "hf" else "GGUF"
    return PlannedModel(spec, query_heads(config), isinstance(config, ModelConfig), kind)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.model and args.model_option:
        raise KvabiError("plan: give the model once (MODEL or --model)")
    if args.descriptor:
        desc = from_text(args.descriptor)
        model = PlannedModel(desc.model, _kv_heads(desc.model), False, "descriptor")
    else:
        model = planned_model(args.model or args.model_option or DEFAULT_MODEL)
        desc = _descriptor(model.spec, args)
    print(f"model: {model.source}, {len(model.spec.layers)} layers")
    print(f"descriptor: {desc}")
    _print_memory(desc, args.context, args.concurrency)
    _print_paths(desc, model)
    if args.tp > 1:
        _print_tp(model, desc, args)
    return 0


def _print_tp(model: PlannedModel, desc: Descriptor, args: argparse.Namespace) -> None:
    """Which heads each rank holds, per run of alike layers, and each rank's KV bytes."""
    from kvabi.parallel.tp_plan import plan_tp, rank_spec

    tp = plan_tp(model.query_heads, model.spec.layers, None, args.tp)
    header = ["layers", "rank", "q heads", "KV heads", "KV replicated"]
    print_table(f"Tensor-parallel plan over {args.tp} ranks", header, tp.describe())
    rows = []
    for rank in range(args.tp):
        spec = replace(model.spec, layers=rank_spec(tp, model.spec.layers, rank))
        shard = replace(desc, model=spec)
        per_token = plan(shard, args.context, args.concurrency).bytes_per_token
        rows.append([rank, _bytes(per_token), plan(shard, args.context, 1).bytes_per_request])
    print_table("KV per rank", ["rank", "B/token", f"B/request ({args.context} tokens)"], rows)


def _descriptor(spec: ModelSpec, args: argparse.Namespace) -> Descriptor:
    kinds = {x.kind for x in spec.layers}
    default = "kvabi-compressed" if CENTRIES in kinds else DEFAULT_PLAN_LAYOUTS[spec.layers[0].kind]
    layout = args.layout or default
    options = {} if args.dtype is None else {"dtype": args.dtype}  # None: the preset's own
    if args.block_size is not None:
        options["block_size"] = args.block_size
    return preset_descriptor(layout, spec, **options)


def _kv_heads(spec: ModelSpec) -> tuple[int, ...]:
    """A descriptor alone has no query heads: plan its layers as if one per KV head (MHA)."""
    return tuple(max(x.num_kv_heads, 1) for x in spec.layers)


def _print_memory(desc: Descriptor, context: int, concurrency: int) -> None:
    groups = group_memory(desc, context)
    rows = [
        [g.group.group_id, _ranges(g.group.layer_ids + g.group.reader_ids), describe(g.group.spec),
         _bytes(g.bytes_per_token), g.held_tokens, g.bytes_per_request, g.bytes_per_request / 1e9]
        for g in groups
    ]  # fmt: skip
    header = ["group", "layers", "kind", "B/token", "tokens held", "B/request", "GB/request"]
    print_table(f"KV groups at {context} tokens (one TP shard)", header, rows)
    p = plan(desc, context, concurrency)
    print_table(
        "KV memory plan (one TP shard)",
        ["quantity", "bytes", "GB"],
        [
            ["per token", _bytes(p.bytes_per_token), p.bytes_per_token / 1e9],
            [f"per request ({p.context} tokens)", p.bytes_per_request, p.bytes_per_request / 1e9],
            [f"{p.concurrency} concurrent requests", p.total_bytes, p.total_bytes / 1e9],
        ],
    )


def _print_paths(desc: Descriptor, model: PlannedModel) -> None:
    from kvabi.engine.attention_plan import attention_paths, compute_dtype, fused_decode_gap
    from kvabi.native.cpu_kernels import cpu_name, kernel_status

    rows = [
        [p.group.group_id, _ranges(p.layer_ids) + (" (shared)" if p.readers else ""),
         p.query_heads, str(p.prefill), str(p.decode)]
        for p in attention_paths(desc, model.query_heads)
    ]  # fmt: skip
    dtype = str(compute_dtype(desc)).removeprefix("torch.")
    title = f"Attention paths (native backend, {dtype}) on {cpu_name()}"
    print_table(title, ["group", "layers", "q heads", "prefill", "decode"], rows)
    why = fused_decode_gap(desc, model.is_llama)
    fused = "where the weights pack for the AMX GEMM" if why is None else f"no: {why}"
    print(f"whole-layer fused decode (FusedDecode): {fused}")
    print(f"kernels: {kernel_status()}")


def _bytes(n: float) -> int | float:
    """Bytes per token as an integer when whole blocks divide evenly, else to a tenth."""
    return int(n) if float(n).is_integer() else round(n, 1)


def describe(spec: LayerSpec) -> str:
    """A layer spec in a few words: `attn 8x128`, `sliding 512 ...`, `mla 512+64`,
    `entries 1/4 of 512 + index 128`."""
    if spec.kind == CENTRIES:
        text = f"entries 1/{spec.ratio} of {spec.latent_dim}"
        return text + (f" + index {spec.indexer_dim}, state" if spec.indexer_dim else "")
    if spec.kind == MLA:
        text = f"mla {spec.latent_dim}+{spec.rope_dim}"
        return text + (f" + indexer {spec.indexer_dim}" if spec.indexer_dim else "")
    dims = f"{spec.k_dim}" if spec.k_dim == spec.v_dim else f"{spec.k_dim}/{spec.v_dim}"
    text = f"attn {spec.num_kv_heads}x{dims}"
    return f"{text}, window {spec.window}" if spec.window else text


def _ranges(ids: tuple[int, ...]) -> str:
    """Layer ids as runs: (0, 1, 2, 5) -> "0-2,5"; every 6th layer stays a list."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
