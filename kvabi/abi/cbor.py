"""Canonical CBOR (RFC 8949 section 4.2.3, "length-first" map key order) for the few types
peers' block hashes encode: unsigned and negative 64-bit ints, bytes, str, lists and tuples
(arrays), dicts (maps), None, bools. It is the encoding of `cbor2.dumps(x, canonical=True)`
(vLLM's `sha256_cbor`) and of Go's `cbor.CanonicalEncOptions()` (llm-d) for these types,
checked against cbor2 in tests/abi/test_hash_schemes.py. Anything else (floats, ints beyond 64 bits,
sets, objects) is refused with a CodecError rather than encoded some other way.
"""

from __future__ import annotations

import struct
from typing import Any

from kvabi.abi.errors import CodecError

_U64_LIMIT = 2**64


def dumps(value: Any) -> bytes:
    """The canonical CBOR bytes of `value`."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 2**8:
        out += bytes((major << 5 | 24, n))
    elif n < 2**16:
        out += bytes((major << 5 | 25,)) + struct.pack(">H", n)
    elif n < 2**32:
        out += bytes((major << 5 | 26,)) + struct.pack(">I", n)
    else:
        out += bytes((major << 5 | 27,)) + struct.pack(">Q", n)


def _encode(value: Any, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out.append(0xF5 if value else 0xF4)
    elif isinstance(value, int):
        _encode_int(value, out)
    elif isinstance(value, bytes | bytearray | memoryview):
        _head(2, len(value), out)
        out += bytes(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(value, list | tuple):
        _head(4, len(value), out)
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        _encode_map(value, out)
    else:
        raise CodecError(f"cbor: cannot encode a {type(value).__name__} canonically here")


def _encode_int(value: int, out: bytearray) -> None:
    if 0 <= value < _U64_LIMIT:
        _head(0, value, out)
    elif -_U64_LIMIT <= value < 0:
        _head(1, -1 - value, out)
    else:
        raise CodecError(f"cbor: integer {value} does not fit in 64 bits")


def _encode_map(value: dict[Any, Any], out: bytearray) -> None:
    items = sorted((dumps(k), v) for k, v in value.items())  # bytewise ...
    items.sort(key=lambda kv: len(kv[0]))  # ... then, stably, shortest key first
    _head(5, len(items), out)
    for key, item in items:
        out += key
        _encode(item, out)
