"""Block events on the wire in vLLM's KV-event format (`vllm/distributed/kv_events.py`, 0.32).

A batch is a msgpack array `[ts, events, data_parallel_rank]` (ts: float64 seconds since the
epoch). Each event is a msgpack map whose first key `type` names it, then its fields in vLLM's
order: `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window}, `BlockRemoved`
{block_hashes, medium, group_idx}, `AllBlocksCleared` {}. Fields that have a default in vLLM
and are at it (None: extra_keys, a uniform cache's group fields, a full group's window, ...)
are omitted, as its encoder (`omit_defaults`) does, so a uniform cache's bytes are those of
vLLM's events without groups. A hybrid cache's events carry their block group
(kvabi/cache/block_events.py); a reader takes a missing `group_idx` as group 0. Hashes are bin
(32-byte kvabi block hashes, docs/ABI.md section 4); a reader takes an integer hash (vLLM's
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, llm-d, SGLang) as its 64 bits, 8 bytes big-endian.
Any msgpack reader can decode it, and vLLM's own `msgspec` decoder for `KVEventBatch` does
(tests/routing/test_kv_event_codec.py).

The array form (`form="array"`): each event is a msgpack array, the tag and then the fields in
vLLM's order, what msgspec writes for vLLM's event structs declared `array_like` (the form vLLM
published before its named-field events, vLLM #42892, and the one positional decoders such as
llm-d's expect). Fields after the last one set are left off, never those without a default in
vLLM (BlockStored's first seven, BlockRemoved's first two), so a decoder of the older, shorter
structs reads it too. `decode_batch` reads both forms and skips event types it does not know,
so a follower keeps up with newer publishers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kvabi.cache.block_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
STORED_FIELDS += ("medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
STORED_FIELDS += ("kv_cache_spec_sliding_window",)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
REQUIRED_FIELDS = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}  # no default
FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
EVENT_FORMS = ("map", "array")


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[BlockEvent, ...]
    data_parallel_rank: int | None = None


def encode_batch(
    events: list[BlockEvent], ts: float, data_parallel_rank: int = 0, form: str = "map"
) -> bytes:
    """One batch's msgpack bytes (what a publisher sends as the payload frame); `form` is
    "map" (vLLM's named-field events) or "array" (the positional form)."""
    if form not in EVENT_FORMS:
        raise ValueError(f"KV event form must be one of {EVENT_FORMS}, got {form!r}")
    encoded = [_encode_event(e) for e in events]
    if form == "array":
        encoded = [_as_array(e) for e in encoded]
    body = [float(ts), encoded, data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def _as_array(event: dict[str, Any]) -> list[Any]:
    """A named-field event as the tag, then its fields in order up to the last one set."""
    kind = event["type"]
    values = [event.get(f) for f in FIELDS[kind]]
    keep = max([REQUIRED_FIELDS[kind]] + [i + 1 for i, v in enumerate(values) if v is not None])
    return [kind, *values[:keep]]


def _encode_event(event: BlockEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            **_set(
                group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            ),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            **_set(group_idx=event.group_idx),
        }
    return {"type": "AllBlocksCleared"}


def _set(**fields: Any) -> dict[str, Any]:
    """The fields not at vLLM's default (None), in order: what `omit_defaults` writes."""
    return {k: v for k, v in fields.items() if v is not None}


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack bytes; raises EventDecodeError for anything else."""
    try:
        body = msgpack.unpackb(payload, raw=False)
        ts, events, *rest = body
        decoded = [_decode_event(e) for e in events]
        return EventBatch(
            float(ts), tuple(e for e in decoded if e is not None), rest[0] if rest else None
        )
    except EventDecodeError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not a KV event batch: {exc}") from exc


def _decode_event(raw: Any) -> BlockEvent | None:
    if isinstance(raw, list | tuple):  # the array form: the tag, then the fields in order
        kind = raw[0]
        raw = {"type": kind, **dict(zip(FIELDS.get(kind, ()), raw[1:], strict=False))}
    if not isinstance(raw, dict):
        raise EventDecodeError(f"an event must be a map or an array, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        return BlockStored(
            _hash_keys(raw["block_hashes"]),
            None if parent is None else _hash_keys([parent])[0],
            tuple(raw.get("token_ids") or ()),
            int(raw["block_size"]),
            raw.get("medium") or "GPU",
            raw.get("group_idx"),
            raw.get("kv_cache_spec_kind"),
            raw.get("kv_cache_spec_sliding_window"),
        )
    if kind == "BlockRemoved":
        medium = raw.get("medium") or "GPU"
        return BlockRemoved(_hash_keys(raw["block_hashes"]), medium, raw.get("group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a newer event type: not ours to follow


def _hash_keys(hashes: Any) -> tuple[bytes, ...]:
    """Block hashes as bytes: bin as is; an integer (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, llm-d, SGLang's int64) as its 64 bits, big-endian."""
    out = []
    for h in hashes:
        if isinstance(h, bytes):
            out.append(h)
        elif isinstance(h, int) and not isinstance(h, bool) and -(2**63) <= h < 2**64:
            out.append((h & (2**64 - 1)).to_bytes(8, "big"))
        else:
            raise EventDecodeError(f"a block hash must be bin or a 64-bit integer, got {h!r:.40}")
    return tuple(out)
