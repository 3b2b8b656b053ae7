"""The KV-cache descriptor: what a cache holds (`ModelSpec`) and how it is laid out (`Layout`).

Both halves are frozen dataclasses, validated at construction, and print to / parse from a
compact text form and canonical JSON (see docs/ABI.md). Physical layout never enters the
compatibility digest, so caches of one model convert on read whatever their layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, replace

from kvabi.abi.axes import tile_product
from kvabi.abi.errors import DescriptorError
from kvabi.abi.json_values import (
    LAYER_FIELD_TYPES,
    LAYOUT_FIELD_TYPES,
    json_bool,
    json_int,
    json_object,
    json_str,
    typed_fields,
)
from kvabi.abi.layout import (  # noqa: F401 - re-exported: the descriptor's public names
    AXIS_LETTERS,
    DTYPES,
    GGML_QUANTS,
    PLANE_PLACEMENTS,
    QUANTS,
    Layout,
    field_error,
)

ABI_MAJOR = 1
ABI_MINOR = 0

ATTN, MLA, SHARED, NONE = "attn", "mla", "shared", "none"
SWA = "swa"  # the JSON kind of an attention layer with a window (ABI 1.2); inside, ATTN + window
DSA = "dsa"  # the JSON kind of an MLA layer with an indexer (ABI 1.3); inside, MLA + indexer_dim
INDEXER = "indexer"  # the sidecar plane of a DeepSeek V3.2 layer: its lightning indexer's keys
CENTRIES = "centries"  # ABI 1.4: a compressed layer's entries, one per `ratio` tokens (DeepSeek V4)
ENTRY, INDEX, STATE = "entry", "index", "state"  # a centries layer's planes and its state sidecar
ROPE_PAIRINGS = ("half", "pairs")  # half: (i, i+d/2) as HF rotate_half / NEOX; pairs: (2i, 2i+1)


@dataclass(frozen=True)
class Plane:
    """One named per-token tensor of a layer: `k`/`v` for attention, `latent`/`rope` for MLA,
    `indexer` for the sidecar of an MLA layer with a lightning indexer (DeepSeek V3.2)."""

    name: str
    num_heads: int
    width: int


@dataclass(frozen=True)
class LayerSpec:
    """What one layer caches. `shares` names the earlier layer whose KV a `shared` layer reads.

    `window` (ABI 1.2): a sliding-window attention layer, whose query at position t attends to
    keys t - window + 1 .. t; 0 is full attention. A `shared` layer states its own window,
    which must equal its target's. `none`: a layer without KV (e.g. a state-space layer).
    `indexer_dim` (ABI 1.3): an MLA layer's lightning-indexer key width (DeepSeek V3.2's
    index_head_dim); the keys are a sidecar plane, stored in a buffer of their own.

    `centries` (ABI 1.4, DeepSeek V4): the entries a compressor pools from every `ratio` tokens
    of the sequence, which the queries of attention layer `compresses` attend to beside its
    window (-1: unbound, the geometry alone, as a group's or an engine pool's spec). One row
    per entry: the `entry` plane (`latent_dim` wide) and, on a layer with a lightning indexer,
    the `index` plane (`indexer_dim` wide); a block of N tokens holds N / ratio rows. With
    `overlap` (CSA: each entry pools two adjacent windows) each block also keeps the
    compressor state at its end, the `state` sidecar: its last window's first-half rows and
    gates, float32 (`state_bytes`), what the next entry needs.
    """

    kind: str = ATTN
    num_kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0
    shares: int = -1
    window: int = 0
    indexer_dim: int = 0
    compresses: int = -1
    ratio: int = 0
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.indexer_dim < 0 or (self.indexer_dim and self.kind not in (MLA, CENTRIES)):
            raise field_error(
                "indexer_dim", f"{self.indexer_dim}: an indexer is >= 0, on MLA or centries only"
            )
        if self.kind != CENTRIES and (self.compresses != -1 or self.ratio or self.overlap):
            raise field_error("ratio", "compresses, ratio and overlap are a centries layer's")
        if self.window < 0 or (self.window and self.kind not in (ATTN, SHARED)):
            raise field_error(
                "window", f"{self.window}: a window is >= 0, on attention or shared layers only"
            )
        if self.kind == ATTN:
            for name in ("num_kv_heads", "k_dim", "v_dim"):
                if getattr(self, name) < 1:
                    raise field_error(
                        name, f"must be >= 1 for an attention layer, got {getattr(self, name)}"
                    )
        elif self.kind == MLA:
            if self.latent_dim < 1 or self.rope_dim < 0:
                raise field_error(
                    "latent_dim",
                    f"MLA needs latent_dim >= 1 and rope_dim >= 0, got "
                    f"{self.latent_dim}/{self.rope_dim}",
                )
        elif self.kind == CENTRIES:
            if self.latent_dim < 1 or self.ratio < 1 or self.compresses < -1:
                raise field_error(
                    "ratio",
                    f"centries needs latent_dim, ratio >= 1 and compresses >= -1, got "
                    f"{self.latent_dim}/{self.ratio}/{self.compresses}",
                )
        elif self.kind == SHARED:
            if self.shares < 0:
                raise field_error(
                    "shares", f"a shared layer must name the layer it reads, got {self.shares}"
                )
        elif self.kind != NONE:
            raise field_error(
                "kind",
                f"unknown layer kind {self.kind!r}; expected attn, mla, centries, shared or none",
            )

    @property
    def has_kv(self) -> bool:
        """Whether the layer owns KV (attention, MLA, compressed entries): shared and `none`
        layers do not."""
        return self.kind in (ATTN, MLA, CENTRIES)

    @property
    def rows_per_token(self) -> tuple[int, int]:
        """(rows, tokens): a centries layer keeps 1 row per `ratio` tokens, others 1 per 1."""
        return (1, self.ratio) if self.kind == CENTRIES else (1, 1)

    @property
    def state_bytes(self) -> int:
        """Bytes of a centries layer's `state` record per block (0 without overlap): per row
        of its last window, each plane's first-half row and gate in float32."""
        if self.kind != CENTRIES or not self.overlap:
            return 0
        return self.ratio * 2 * (self.latent_dim + self.indexer_dim) * 4

    @property
    def planes(self) -> tuple[Plane, ...]:
        if self.kind == ATTN:
            return (
                Plane("k", self.num_kv_heads, self.k_dim),
                Plane("v", self.num_kv_heads, self.v_dim),
            )
        if self.kind == MLA:
            planes = [Plane("latent", 1, self.latent_dim)]
            return tuple(planes + ([Plane("rope", 1, self.rope_dim)] if self.rope_dim else []))
        if self.kind == CENTRIES:
            planes = [Plane(ENTRY, 1, self.latent_dim)]
            return tuple(planes + ([Plane(INDEX, 1, self.indexer_dim)] if self.indexer_dim else []))
        return ()

    @property
    def sidecar_planes(self) -> tuple[Plane, ...]:
        """Planes kept beside the layer's KV in a buffer of their own, never in its groups: an
        MLA layer's indexer keys, a centries layer's per-block state."""
        if self.kind == CENTRIES:
            return (Plane(STATE, 1, self.state_bytes),) if self.overlap else ()
        return (Plane(INDEXER, 1, self.indexer_dim),) if self.indexer_dim else ()

    @property
    def num_heads(self) -> int:
        if self.kind == ATTN:
            return self.num_kv_heads
        return 1 if self.kind in (MLA, CENTRIES) else 0


class _CachedHash:
    """Hash once: descriptors key `lru_cache`s on hot paths (every section of every container
    read), and hashing 30+ nested layer specs each time was most of a one-block read. The cached
    value is dropped when pickled (str hashes differ between processes)."""

    def __hash__(self) -> int:
        value = self.__dict__.get("_hash")
        if value is None:
            value = hash(tuple(getattr(self, f.name) for f in fields(self)))  # type: ignore[arg-type]
            object.__setattr__(self, "_hash", value)
        return value

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_digest")}


@dataclass(frozen=True)
class ModelSpec(_CachedHash):
    """What the cache holds, independent of any engine.

    `k_post_rope`: K is stored after RoPE. `rope_pairing`: the order of K's rotary dims
    (`half` as HF, `pairs` as llama.cpp's Llama K); caches that differ only in it convert by a
    per-head permutation. `rope_dim`: rotary dims per head (0 = all of k_dim).
    """

    layers: tuple[LayerSpec, ...]
    fingerprint: str = ""
    k_post_rope: bool = True
    rope_pairing: str = "half"
    rope_dim: int = 0
    __hash__ = _CachedHash.__hash__  # explicit, or @dataclass would generate its own

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise field_error("layers", "a cache needs at least one layer")
        for i, layer in enumerate(self.layers):
            if layer.kind == SHARED:
                _check_shares(self.layers, i, layer)
            if layer.kind == CENTRIES:
                _check_compresses(self.layers, i, layer)
        if self.rope_pairing not in ROPE_PAIRINGS:
            raise field_error(
                "rope_pairing", f"{self.rope_pairing!r}; expected one of {ROPE_PAIRINGS}"
            )
        k_dims = [lay.k_dim for lay in self.layers if lay.kind == ATTN]
        if self.rope_dim < 0 or self.rope_dim % 2 or (k_dims and self.rope_dim > min(k_dims)):
            raise field_error(
                "rope_dim", f"{self.rope_dim} must be even and <= every layer's k_dim"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def min_version(self) -> tuple[int, int]:
        """1.4 with compressed entries; 1.3 when a layer has an indexer; 1.2 when a layer has a
        window or no KV; else 1.0."""
        if any(x.kind == CENTRIES for x in self.layers):
            return (1, 4)
        if any(x.indexer_dim for x in self.layers):
            return (1, 3)
        is_hybrid = any(x.window or x.kind == NONE for x in self.layers)
        return (1, 2) if is_hybrid else (1, 0)

    def compat_digest(self) -> str:
        """Hex SHA-256 (first 16 bytes) of everything two caches must agree on to exchange data.

        The RoPE pairing is left out: caches that differ in it convert by a permutation.
        Computed once per spec (every fetch and store lookup asks for it).
        """
        value = self.__dict__.get("_digest")
        if value is None:
            value = self._compute_digest()
            object.__setattr__(self, "_digest", value)
        return value

    def _compute_digest(self) -> str:
        body = {
            "fingerprint": self.fingerprint,
            "k_post_rope": self.k_post_rope,
            "layers": [_layer_json(lay) for lay in self.layers],
            "rope_dim": self.rope_dim,
        }
        return hashlib.sha256(_canonical(body).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Descriptor(_CachedHash):
    """A KV cache's full description: the model part and the layout part."""

    model: ModelSpec
    layout: Layout
    version: tuple[int, int] = field(default=(ABI_MAJOR, ABI_MINOR))
    __hash__ = _CachedHash.__hash__  # explicit, or @dataclass would generate its own

    def __post_init__(self) -> None:
        # A descriptor is written as the lowest version that has the features it uses, so a
        # 1.0 reader still reads every cache 1.0 can describe and refuses the rest.
        version = max(tuple(self.version), self.layout.min_version, self.model.min_version)
        object.__setattr__(self, "version", version)
        _check_pair(self.model, self.layout)

    def with_layout(self, **changes: object) -> Descriptor:
        return replace(self, layout=replace(self.layout, **changes))

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces, UTF-8 safe. Stable across runs and languages."""
        return _canonical(self.to_dict())

    def to_dict(self) -> dict:
        m, lay = self.model, self.layout
        return {
            "kvabi": f"{self.version[0]}.{self.version[1]}",
            "model": {
                "fingerprint": m.fingerprint,
                "k_post_rope": m.k_post_rope,
                "layers": [_layer_json(x) for x in m.layers],
                "rope_dim": m.rope_dim,
                "rope_pairing": m.rope_pairing,
            },
            "layout": {
                "axes": lay.axes,
                "block_size": lay.block_size,
                "dtype": lay.dtype,
                "name": lay.name,
                "planes": lay.planes,
                "quant": lay.quant,
                "scales": list(lay.scales),
                "tp_rank": lay.tp_rank,
                "tp_size": lay.tp_size,
                "v_axes": lay.v_axes,
            },
        }

    @classmethod
    def from_json(cls, text: str | bytes) -> Descriptor:
        try:
            return cls.from_dict(json.loads(text))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DescriptorError(f"descriptor JSON does not parse: {exc}") from exc

    @classmethod
    def from_dict(cls, data: dict) -> Descriptor:
        """Parse, refusing an unknown major version and ignoring unknown fields of a known one.

        Every value must have its JSON type (docs/ABI.md 2.1): `true` is not an integer, nor
        is `4.0`; absent optional fields take their defaults."""
        try:
            version = parse_version(json_str(json_object(data, "descriptor")["kvabi"], "kvabi"))
            m = json_object(data["model"], "model")
            layers = m["layers"]
            if not isinstance(layers, list):
                raise DescriptorError(f"model.layers: expected a JSON list, got {layers!r}")
            model = ModelSpec(
                layers=tuple(_layer_from_json(json_object(x, "layer")) for x in layers),
                fingerprint=json_str(m["fingerprint"], "model.fingerprint"),
                k_post_rope=json_bool(m["k_post_rope"], "model.k_post_rope"),
                rope_pairing=json_str(m["rope_pairing"], "model.rope_pairing"),
                rope_dim=json_int(m["rope_dim"], "model.rope_dim"),
            )
            lay = json_object(data["layout"], "layout")
            layout = Layout(**typed_fields(lay, LAYOUT_FIELD_TYPES, "layout"))
            return cls(model, layout, version)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, DescriptorError):
                raise
            raise DescriptorError(f"descriptor is malformed: {exc!r}") from exc

    def __str__(self) -> str:
        from kvabi.abi.text_form import to_text

        return to_text(self)


def parse_version(text: str) -> tuple[int, int]:
    """'MAJOR.MINOR' -> (major, minor); an unknown major version is refused."""
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError as exc:
        raise field_error("kvabi", f"version must be MAJOR.MINOR, got {text!r}") from exc
    if major != ABI_MAJOR:
        raise field_error(
            "kvabi", f"major version {major} is not supported (this reader is {ABI_MAJOR})"
        )
    return major, minor


def _check_shares(layers: tuple[LayerSpec, ...], i: int, layer: LayerSpec) -> None:
    """A shared layer reads an earlier layer with KV of its own, of the same attention kind."""
    target = layers[layer.shares] if layer.shares < len(layers) else None
    if layer.shares >= i or target is None or not target.has_kv:
        raise field_error(
            "shares",
            f"layer {i} shares layer {layer.shares}, which is not an earlier layer with KV "
            "of its own",
        )
    if target.window != layer.window:
        raise field_error(
            "shares",
            f"layer {i} (window {layer.window}) shares layer {layer.shares} of another kind "
            f"(window {target.window})",
        )


def _check_compresses(layers: tuple[LayerSpec, ...], i: int, layer: LayerSpec) -> None:
    """A centries layer extends an earlier attention layer, which no other one extends (an
    unbound one, -1, is a pool's geometry: nothing to check)."""
    if layer.compresses == -1:
        return
    target = layers[layer.compresses] if layer.compresses < i else None
    if target is None or target.kind != ATTN:
        raise field_error(
            "compresses",
            f"layer {i} compresses layer {layer.compresses}, which is not an earlier attention "
            "layer",
        )
    others = [j for j, x in enumerate(layers[:i]) if x.kind == CENTRIES]
    if any(layers[j].compresses == layer.compresses for j in others):
        raise field_error("compresses", f"layer {layer.compresses} is compressed twice")


def _check_pair(model: ModelSpec, lay: Layout) -> None:
    owners = [(i, x) for i, x in enumerate(model.layers) if x.has_kv]
    for i, layer in owners:
        planes = layer.planes
        if lay.planes == "axis" and len({(p.num_heads, p.width) for p in planes}) > 1:
            raise field_error(
                "axes",
                f"layer {i}: planes of different sizes cannot share a K axis; "
                "use planes=concat or separate",
            )
        if layer.kind == ATTN and layer.num_kv_heads % lay.tp_size:
            raise field_error(
                "tp_size",
                f"layer {i} has num_kv_heads={layer.num_kv_heads}, not "
                f"divisible by tp_size={lay.tp_size}",
            )
        if lay.quant == "fp8_ds_mla" and not (
            layer.kind == MLA and layer.latent_dim == 512 and layer.rope_dim == 64
        ):
            raise field_error(
                "quant",
                f"fp8_ds_mla records need MLA with kv_lora_rank 512 and rope 64; "
                f"layer {i} is {_layer_text(layer)}",
            )
        if lay.quant in GGML_QUANTS and any(p.width % 32 for p in planes):
            raise field_error(
                "quant",
                f"{lay.quant} packs 32-element blocks; layer {i} has a width "
                "that is not a multiple of 32",
            )
    _check_tiles(model, lay)
    _check_centries(model, lay)
    if lay.is_cross_layer and any(x.indexer_dim for x in model.layers):
        raise field_error("axes", "an indexer plane needs a per-layer layout (no L axis)")
    if lay.quant == "fp8_ds_mla" and lay.planes != "concat":
        raise field_error(
            "planes", "fp8_ds_mla packs latent and rope into one record: planes=concat"
        )
    if lay.is_cross_layer and len({x for _, x in owners}) > 1:
        raise field_error("axes", "an L axis needs every layer to have the same geometry")
    if lay.scales and len(lay.scales) != 2 * model.num_layers:
        raise field_error(
            "scales",
            f"{len(lay.scales)} values; per_tensor needs 2 per layer ({2 * model.num_layers})",
        )


def _check_centries(model: ModelSpec, lay: Layout) -> None:
    """Compressed entries sit in paged blocks of whole windows, unquantised, per layer."""
    for i, layer in enumerate(model.layers):
        if layer.kind != CENTRIES:
            continue
        if not lay.is_paged or lay.block_size % layer.ratio:
            raise field_error(
                "block_size",
                f"layer {i} pools {layer.ratio} tokens per entry: a paged layout whose block "
                f"size is a multiple of it, got {lay.block_size if lay.is_paged else 'unpaged'}",
            )
        if lay.quant != "none" or lay.is_cross_layer or lay.is_tiled or lay.tp_size != 1:
            raise field_error(
                "quant", "compressed entries need an unquantised, untiled, per-layer layout"
            )


def _check_tiles(model: ModelSpec, lay: Layout) -> None:
    """Tiles of H and C must divide every owner layer's heads (per shard) and plane widths."""
    for name, axes in (("axes", lay.axes), ("v_axes", lay.v_axes)):
        if not axes:
            continue
        h_tile, c_tile = tile_product(axes, "H"), tile_product(axes, "C")
        for i, layer in enumerate(model.layers):
            if not layer.has_kv:
                continue
            heads = layer.num_kv_heads // lay.tp_size if layer.kind == ATTN else 1
            if heads % h_tile or any(p.width % c_tile for p in layer.planes):
                raise field_error(
                    name,
                    f"{axes!r}: tiles of {h_tile} heads x {c_tile} elements do not divide "
                    f"layer {i} ({_layer_text(layer)}, {heads} heads per shard)",
                )


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _layer_json(layer: LayerSpec) -> dict:
    """A windowed attention layer is kind `swa` (1.2), so that a 1.0/1.1 reader, which ignores
    fields it does not know, refuses it instead of reading it as full attention; an MLA layer
    with an indexer is kind `dsa` (1.3), so that an older reader refuses it instead of
    reading it as MLA without the indexer plane."""
    window = {"window": layer.window} if layer.window else {}
    if layer.kind == ATTN:
        return {
            "kind": SWA if layer.window else ATTN,
            "k_dim": layer.k_dim,
            "num_kv_heads": layer.num_kv_heads,
            "v_dim": layer.v_dim,
            **window,
        }
    if layer.kind == MLA:
        mla = {"latent_dim": layer.latent_dim, "rope_dim": layer.rope_dim}
        if layer.indexer_dim:
            return {"kind": DSA, "indexer_dim": layer.indexer_dim, **mla}
        return {"kind": MLA, **mla}
    if layer.kind == NONE:
        return {"kind": NONE}
    if layer.kind == CENTRIES:
        index = {"indexer_dim": layer.indexer_dim} if layer.indexer_dim else {}
        return {
            "kind": CENTRIES,
            "compresses": layer.compresses,
            "latent_dim": layer.latent_dim,
            "overlap": layer.overlap,
            "ratio": layer.ratio,
            **index,
        }
    return {"kind": SHARED, "shares": layer.shares, **window}


def _layer_from_json(data: dict) -> LayerSpec:
    fields_ = typed_fields(data, LAYER_FIELD_TYPES, "layer")
    if fields_.get("kind") == SWA:
        if fields_.get("window", 0) < 1:
            raise field_error("window", "a swa layer needs window >= 1")
        fields_["kind"] = ATTN
    elif fields_.get("kind") == ATTN and fields_.get("window"):
        raise field_error("window", "an attn layer has no window (a windowed layer is swa)")
    elif fields_.get("kind") == DSA:
        if fields_.get("indexer_dim", 0) < 1:
            raise field_error("indexer_dim", "a dsa layer needs indexer_dim >= 1")
        fields_["kind"] = MLA
    elif "indexer_dim" in fields_ and fields_.get("kind") != CENTRIES:
        raise field_error(
            "indexer_dim", "only a dsa layer has an indexer (an MLA layer with one is dsa)"
        )
    return LayerSpec(**fields_)


def _layer_text(layer: LayerSpec) -> str:
    from kvabi.abi.text_form import layer_to_text

    return layer_to_text(layer)
