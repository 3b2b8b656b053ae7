"""The short text form of a descriptor, for the CLI and logs. Round-trips to the same object.

Example: ``kvabi/1.0 layers=30*attn:3x64 fp=smollm2 rope=post:half axes=LKBNHC bs=16 dtype=bf16``.
Fields are space-separated ``key=value``; defaults (quant=none, tp=0/1, ...) are omitted.
Layers are run-length encoded: ``attn:HxK`` or ``attn:HxK/V``, ``swaW:HxK`` (window W, 1.2),
``mla:LATENT+ROPE``, ``dsa:LATENT+ROPE+INDEXER`` (1.3), ``shared@J`` or ``shared@J:swaW``, ``none``,
``centries@J:RxD``, ``centries@J:RxD+I``, either ending ``o`` with overlap (1.4).
"""

from __future__ import annotations

from itertools import groupby
from urllib.parse import quote, unquote

from kvabi.abi.descriptor import (
    ATTN,
    CENTRIES,
    DSA,
    MLA,
    NONE,
    SHARED,
    SWA,
    Descriptor,
    LayerSpec,
    Layout,
    ModelSpec,
    parse_version,
)
from kvabi.abi.errors import DescriptorError


def layer_to_text(layer: LayerSpec) -> str:
    kind = f"{SWA}{layer.window}" if layer.window else ATTN
    if layer.kind == ATTN:
        dims = f"{layer.k_dim}" if layer.k_dim == layer.v_dim else f"{layer.k_dim}/{layer.v_dim}"
        return f"{kind}:{layer.num_kv_heads}x{dims}"
    if layer.kind == MLA and layer.indexer_dim:
        return f"{DSA}:{layer.latent_dim}+{layer.rope_dim}+{layer.indexer_dim}"
    if layer.kind == MLA:
        return f"mla:{layer.latent_dim}+{layer.rope_dim}"
    if layer.kind == NONE:
        return NONE
    if layer.kind == CENTRIES:
        index = f"+{layer.indexer_dim}" if layer.indexer_dim else ""
        overlap = "o" if layer.overlap else ""
        return f"{CENTRIES}@{layer.compresses}:{layer.ratio}x{layer.latent_dim}{index}{overlap}"
    return f"shared@{layer.shares}" + (f":{kind}" if layer.window else "")


def layer_from_text(text: str) -> LayerSpec:
    kind, _, rest = text.partition(":")
    try:
        window = int(kind[len(SWA) :]) if kind.startswith(SWA) else 0
        if kind == ATTN or window:
            heads, _, dims = rest.partition("x")
            k_dim, _, v_dim = dims.partition("/")
            return LayerSpec(ATTN, int(heads), int(k_dim), int(v_dim or k_dim), window=window)
        if kind == MLA:
            latent, _, rope = rest.partition("+")
            return LayerSpec(MLA, latent_dim=int(latent), rope_dim=int(rope or 0))
        if kind == DSA:
            latent, rope, indexer = rest.split("+")
            if int(indexer) < 1:
                raise ValueError(indexer)
            return LayerSpec(
                MLA, latent_dim=int(latent), rope_dim=int(rope), indexer_dim=int(indexer)
            )
        if text == NONE:
            return LayerSpec(NONE)
        if kind.startswith(f"{CENTRIES}@"):
            return _centries_from_text(int(kind[len(CENTRIES) + 1 :]), rest)
        if kind.startswith("shared@"):
            window = int(rest[len(SWA) :]) if rest.startswith(SWA) else 0
            if rest and not window:
                raise ValueError(rest)
            return LayerSpec(SHARED, shares=int(kind[len("shared@") :]), window=window)
    except ValueError:
        pass
    raise DescriptorError(f"layers: cannot read layer {text!r}")


def _centries_from_text(compresses: int, rest: str) -> LayerSpec:
    """`RxD`, `RxD+I`, either with an `o` suffix (overlap)."""
    overlap = rest.endswith("o")
    ratio, _, dims = rest.removesuffix("o").partition("x")
    latent, _, index = dims.partition("+")
    return LayerSpec(
        CENTRIES, latent_dim=int(latent), indexer_dim=int(index or 0), compresses=compresses,
        ratio=int(ratio), overlap=overlap,
    )  # fmt: skip


def to_text(desc: Descriptor) -> str:
    m, lay = desc.model, desc.layout
    runs = [(layer_to_text(k), len(list(g))) for k, g in groupby(m.layers)]
    layers = ",".join(t if n == 1 else f"{n}*{t}" for t, n in runs)
    rope = f"{'post' if m.k_post_rope else 'pre'}:{m.rope_pairing}" + (
        f":{m.rope_dim}" if m.rope_dim else ""
    )
    fields = [
        f"kvabi/{desc.version[0]}.{desc.version[1]}",
        f"layers={layers}",
        f"fp={quote(m.fingerprint, safe='')}",
        f"rope={rope}",
        f"axes={lay.axes}",
        f"bs={lay.block_size}",
        f"dtype={lay.dtype}",
    ]
    optional = {
        "quant": (lay.quant, "none"),
        "planes": (lay.planes, "axis"),
        "v_axes": (lay.v_axes, ""),
        "tp": (f"{lay.tp_rank}/{lay.tp_size}", "0/1"),
        "scales": (",".join(repr(s) for s in lay.scales), ""),
        "name": (quote(lay.name, safe=""), ""),
    }
    fields += [f"{k}={v}" for k, (v, default) in optional.items() if v != default]
    return " ".join(fields)


def from_text(text: str) -> Descriptor:
    """Parse the text form; raises DescriptorError naming what is wrong."""
    head, *pairs = text.split()
    if not head.startswith("kvabi/"):
        raise DescriptorError(f"text form must start with 'kvabi/MAJOR.MINOR', got {head!r}")
    try:
        version = parse_version(head[len("kvabi/") :])
        kv = dict(p.split("=", 1) for p in pairs)
        return Descriptor(_model(kv), _layout(kv), version)
    except (KeyError, ValueError) as exc:
        if isinstance(exc, DescriptorError):
            raise
        raise DescriptorError(f"text form does not parse ({exc!r}): {text!r}") from exc


def _model(kv: dict[str, str]) -> ModelSpec:
    layers: list[LayerSpec] = []
    for item in kv["layers"].split(","):
        count, star, body = item.partition("*")
        layers += [layer_from_text(body)] * int(count) if star else [layer_from_text(item)]
    post, pairing, *rope_dim = kv["rope"].split(":")
    if post not in ("post", "pre"):
        raise DescriptorError(f"rope: expected post or pre, got {post!r}")
    return ModelSpec(
        tuple(layers),
        unquote(kv["fp"]),
        post == "post",
        pairing,
        int(rope_dim[0]) if rope_dim else 0,
    )


def _layout(kv: dict[str, str]) -> Layout:
    rank, size = kv.get("tp", "0/1").split("/")
    scales = tuple(float(s) for s in kv["scales"].split(",")) if kv.get("scales") else ()
    return Layout(
        axes=kv["axes"],
        block_size=int(kv["bs"]),
        dtype=kv["dtype"],
        quant=kv.get("quant", "none"),
        planes=kv.get("planes", "axis"),
        v_axes=kv.get("v_axes", ""),
        tp_rank=int(rank),
        tp_size=int(size),
        scales=scales,
        name=unquote(kv.get("name", "")),
    )
