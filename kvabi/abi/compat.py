"""Compatibility checks: the same model and planes, or a clear error saying what differs."""

from __future__ import annotations

from kvabi.abi.descriptor import LayerSpec, ModelSpec
from kvabi.abi.errors import IncompatibleError
from kvabi.abi.text_form import layer_to_text


def model_differences(a: ModelSpec, b: ModelSpec) -> list[str]:
    """Human-readable list of what differs between two model parts (pairing excluded)."""
    diffs = []
    if a.fingerprint != b.fingerprint:
        diffs.append(f"model fingerprint {a.fingerprint!r} != {b.fingerprint!r}")
    if a.num_layers != b.num_layers:
        diffs.append(f"num_layers {a.num_layers} != {b.num_layers}")
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=False)):
        if x != y:
            diffs.append(f"layer {i}: {layer_to_text(x)} != {layer_to_text(y)}{_sidecar(x, y)}")
    if a.k_post_rope != b.k_post_rope:
        diffs.append(f"K post-RoPE {a.k_post_rope} != {b.k_post_rope}")
    if a.rope_dim != b.rope_dim:
        diffs.append(f"rope_dim {a.rope_dim} != {b.rope_dim}")
    return diffs


def check_compatible(expected: ModelSpec, got: ModelSpec) -> None:
    """Raise IncompatibleError unless the two caches hold the same model's KV."""
    diffs = model_differences(expected, got)
    if diffs:
        raise IncompatibleError(
            "caches are of different models: "
            + "; ".join(diffs[:5])
            + (f" (+{len(diffs) - 5} more)" if len(diffs) > 5 else "")
        )


def _sidecar(a: LayerSpec, b: LayerSpec) -> str:
    """Name the sidecar planes one layer declares and the other lacks (or sizes otherwise)."""
    planes_a = {p.name: p.width for p in a.sidecar_planes}
    planes_b = {p.name: p.width for p in b.sidecar_planes}
    names = sorted(
        n for n in planes_a.keys() | planes_b.keys() if planes_a.get(n) != planes_b.get(n)
    )
    return "".join(
        f" (plane {n!r}: {planes_a.get(n, 'absent')} != {planes_b.get(n, 'absent')})" for n in names
    )
