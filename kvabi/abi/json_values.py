"""Typed reads of a descriptor's JSON values (docs/ABI.md 2.1).

Python's `json` gives `True` for `true` (and `bool` is an `int`) and `4.0` for `4.0`; taken as
integers they would be accepted, written back as `true` / `4.0` and change the compatibility
digest. So every value is read as exactly the JSON type the spec gives it, or refused.
"""

from __future__ import annotations

from kvabi.abi.errors import DescriptorError


def json_int(value: object, name: str) -> int:
    """A JSON integer: not a boolean, not a float (even one with an integral value)."""
    if type(value) is not int:
        raise DescriptorError(f"{name}: expected a JSON integer, got {value!r}")
    return value


def json_str(value: object, name: str) -> str:
    """A JSON string."""
    if not isinstance(value, str):
        raise DescriptorError(f"{name}: expected a JSON string, got {value!r}")
    return value


def json_bool(value: object, name: str) -> bool:
    """A JSON `true` or `false` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise DescriptorError(f"{name}: expected true or false, got {value!r}")
    return value


def json_floats(value: object, name: str) -> tuple[float, ...]:
    """A JSON list of numbers (integers read as floats; booleans and strings refused)."""
    if not isinstance(value, list):
        raise DescriptorError(f"{name}: expected a JSON list of numbers, got {value!r}")
    for x in value:
        if type(x) not in (int, float):
            raise DescriptorError(f"{name}: expected numbers, got {x!r}")
    return tuple(float(x) for x in value)


def json_object(value: object, name: str) -> dict:
    """A JSON object."""
    if not isinstance(value, dict):
        raise DescriptorError(f"{name}: expected a JSON object, got {value!r}")
    return value


LAYOUT_FIELD_TYPES = {
    "axes": json_str,
    "block_size": json_int,
    "dtype": json_str,
    "quant": json_str,
    "planes": json_str,
    "v_axes": json_str,
    "tp_rank": json_int,
    "tp_size": json_int,
    "scales": json_floats,
    "name": json_str,
}

LAYER_FIELD_TYPES = {
    "kind": json_str,
    **{
        k: json_int
        for k in (
            "num_kv_heads",
            "k_dim",
            "v_dim",
            "latent_dim",
            "rope_dim",
            "shares",
            "window",
            "indexer_dim",
            "compresses",
            "ratio",
        )
    },
    "overlap": json_bool,
}


def typed_fields(data: dict, types: dict, where: str) -> dict:
    """The entries of `data` whose key is in `types`, each read as its type (others ignored)."""
    return {k: types[k](v, f"{where}.{k}") for k, v in data.items() if k in types}
