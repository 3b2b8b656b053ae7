"""KV event batches on the wire: golden bytes, equal to what vLLM 0.32's own encoder writes for
the same batch, and readable by vLLM's decoder (a subscriber that is not ours)."""

import json
import subprocess
from pathlib import Path

import msgpack
import pytest

from kvabi.cache.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvabi.routing.kv_event_codec import EventBatch, EventDecodeError, decode_batch, encode_batch

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
EVENTS = [
    BlockStored((b"\x01" * 4,), None, (1, 2), 2, "CPU"),
    BlockRemoved((b"\x02",), "CPU"),
    AllBlocksCleared(),
]
# msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[b"\1" * 4],
# parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None, medium="CPU",
# lora_name=None), BlockRemoved(block_hashes=[b"\2"], medium="CPU"), AllBlocksCleared()],
# data_parallel_rank=0)) with vLLM 0.32.0
GOLDEN = bytes.fromhex(
    "93cb3ff8000000000000"  # [1.5,
    "93"  # [
    "88a474797065ab426c6f636b53746f726564"  # {"type": "BlockStored",
    "ac626c6f636b5f68617368657391c40401010101"  # "block_hashes": [b"\1\1\1\1"],
    "b1706172656e745f626c6f636b5f68617368c0"  # "parent_block_hash": None,
    "a9746f6b656e5f696473920102"  # "token_ids": [1, 2],
    "aa626c6f636b5f73697a6502"  # "block_size": 2,
    "a76c6f72615f6964c0"  # "lora_id": None,
    "a66d656469756da3435055"  # "medium": "CPU",
    "a96c6f72615f6e616d65c0"  # "lora_name": None},
    "83a474797065ac426c6f636b52656d6f766564"  # {"type": "BlockRemoved",
    "ac626c6f636b5f68617368657391c40102"  # "block_hashes": [b"\2"],
    "a66d656469756da3435055"  # "medium": "CPU"},
    "81a474797065b0416c6c426c6f636b73436c6561726564"  # {"type": "AllBlocksCleared"}],
    "00"  # 0]
)

HYBRID = [
    BlockStored((b"\x01" * 4,), None, (1, 2), 2, "CPU", 0, "sliding_window", 4),
    BlockStored((b"\x01" * 4,), None, (1, 2), 2, "CPU", 1, "full_attention"),
    BlockRemoved((b"\x02",), "CPU", 0),
]
# the same, with vLLM 0.32.0's BlockStored(..., group_idx=0, kv_cache_spec_kind="sliding_window",
# kv_cache_spec_sliding_window=4), BlockStored(..., group_idx=1,
# kv_cache_spec_kind="full_attention"), BlockRemoved(..., group_idx=0): the group fields follow
# lora_name (extra_keys, at its default, is left out), a full group's window too
STORED = (
    "a474797065ab426c6f636b53746f726564"  # "type": "BlockStored",
    "ac626c6f636b5f68617368657391c40401010101"  # "block_hashes": [b"\1\1\1\1"],
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102"  # parent, token_ids
    "aa626c6f636b5f73697a6502a76c6f72615f6964c0"  # "block_size": 2, "lora_id": None,
    "a66d656469756da3435055a96c6f72615f6e616d65c0"  # "medium": "CPU", "lora_name": None,
)
HYBRID_GOLDEN = bytes.fromhex(
    "93cb3ff800000000000093"  # [1.5, [
    "8b" + STORED + "a967726f75705f69647800"  # {..., "group_idx": 0,
    "b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77"  # kind: "sliding_window"
    "bc6b765f63616368655f737065635f736c6964696e675f77696e646f7704"  # "..._sliding_window": 4},
    "8a" + STORED + "a967726f75705f69647801"  # {..., "group_idx": 1,
    "b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e"  # "full_attention"},
    "84a474797065ac426c6f636b52656d6f766564"  # {"type": "BlockRemoved",
    "ac626c6f636b5f68617368657391c40102a66d656469756da3435055"  # block_hashes, "medium": "CPU",
    "a967726f75705f69647800"  # "group_idx": 0}],
    "00"  # 0]
)

VLLM_DECODE = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read())
out = [batch.ts, batch.data_parallel_rank]
for e in batch.events:
    d = {f: getattr(e, f) for f in e.__struct_fields__}
    d = {k: (v.hex() if isinstance(v, bytes) else [x.hex() if isinstance(x, bytes) else x
         for x in v] if isinstance(v, list) else v) for k, v in d.items()}
    out.append([type(e).__name__, d])
print("RESULT " + __import__("json").dumps(out))
"""


def test_encoding_is_the_golden_bytes():
    assert encode_batch(EVENTS, 1.5, 0) == GOLDEN


def test_a_hybrid_caches_events_carry_their_group_as_vllms_encoder_writes_them():
    assert encode_batch(HYBRID, 1.5, 0) == HYBRID_GOLDEN
    assert decode_batch(HYBRID_GOLDEN) == EventBatch(1.5, tuple(HYBRID), 0)
    old = msgpack.packb(  # the array form, with vLLM's later fields in order
        [1.0, [["BlockStored", [b"h"], None, [7], 1, None, "GPU", None, None, 2, "full_attention"]]]
    )
    assert decode_batch(old).events == (
        BlockStored((b"h",), None, (7,), 1, "GPU", 2, "full_attention"),
    )


def test_decoding_round_trips_and_reads_the_older_array_form():
    assert decode_batch(GOLDEN) == EventBatch(1.5, tuple(EVENTS), 0)
    old = msgpack.packb(
        [2.0, [["BlockStored", [b"h"], b"p", [7], 1, None], ["BlockRemoved", [b"h"], "GPU"]]]
    )
    assert decode_batch(old) == EventBatch(
        2.0, (BlockStored((b"h",), b"p", (7,), 1, "GPU"), BlockRemoved((b"h",), "GPU")), None
    )


def test_unknown_event_types_are_skipped_and_garbage_is_refused():
    payload = msgpack.packb([1.0, [{"type": "BlockTouched", "x": 1}, {"type": "AllBlocksCleared"}]])
    assert decode_batch(payload).events == (AllBlocksCleared(),)
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [3]])):
        with pytest.raises(EventDecodeError):
            decode_batch(bad)


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM installed")
def test_vllms_own_decoder_reads_our_batches():
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    events = [
        BlockStored((h1, h2), None, tuple(range(8)), 4, "CPU"),
        BlockStored((b"\x09" * 32,), h2, (8, 9, 10, 11), 4, "CPU"),
        BlockRemoved((h2, h1), "CPU"),
        AllBlocksCleared(),
    ]
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_DECODE],
        input=encode_batch(events, 1700000000.25, 0),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    line = next(x for x in run.stdout.decode().splitlines() if x.startswith("RESULT "))
    ts, rank, stored, chained, removed, cleared = json.loads(line[len("RESULT ") :])
    assert (ts, rank) == (1700000000.25, 0)
    assert stored == [
        "BlockStored",
        {
            "block_hashes": [h1.hex(), h2.hex()],
            "parent_block_hash": None,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
            "extra_keys": None,
            "group_idx": None,
            "kv_cache_spec_kind": None,
            "kv_cache_spec_sliding_window": None,
            "locality": None,
            "ownership": None,
            "session_id": None,
        },
    ]
    assert chained[1]["parent_block_hash"] == h2.hex()
    assert chained[1]["block_hashes"] == ["09" * 32]
    assert removed[0] == "BlockRemoved"
    assert removed[1]["block_hashes"] == [h2.hex(), h1.hex()]
    assert removed[1]["medium"] == "CPU"
    assert cleared == ["AllBlocksCleared", {}]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM installed")
def test_vllms_own_decoder_reads_a_hybrid_caches_groups():
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    events = [
        BlockStored((h1, h2), None, tuple(range(8)), 4, "CPU", 0, "sliding_window", 6),
        BlockStored((h1, h2), None, tuple(range(8)), 4, "CPU", 1, "full_attention"),
        BlockRemoved((h1,), "CPU", 0),
        BlockRemoved((h2,), "CPU"),  # no group: vLLM reads None
    ]
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_DECODE],
        input=encode_batch(events, 2.0, 0),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    line = next(x for x in run.stdout.decode().splitlines() if x.startswith("RESULT "))
    _, _, sliding, full, removed, ungrouped = json.loads(line[len("RESULT ") :])
    fields = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    assert [sliding[1][f] for f in fields] == [0, "sliding_window", 6]
    assert [full[1][f] for f in fields] == [1, "full_attention", None]
    assert sliding[1]["block_hashes"] == full[1]["block_hashes"] == [h1.hex(), h2.hex()]
    assert removed[0] == "BlockRemoved"
    assert (removed[1]["block_hashes"], removed[1]["group_idx"]) == ([h1.hex()], 0)
    assert ungrouped[1]["group_idx"] is None


# The array form of EVENTS: each event the tag, then vLLM's fields in order up to the last set
# one, never fewer than those without a default (BlockStored's seven, BlockRemoved's two)
ARRAY_GOLDEN = bytes.fromhex(
    "93cb3ff8000000000000"  # [1.5,
    "93"  # [
    "98ab426c6f636b53746f726564"  # ["BlockStored",
    "91c40401010101c0920102"  # [b"\1\1\1\1"], None, [1, 2],
    "02c0a3435055c0"  # 2, None, "CPU", None],
    "93ac426c6f636b52656d6f76656491c40102a3435055"  # ["BlockRemoved", [b"\2"], "CPU"],
    "91b0416c6c426c6f636b73436c6561726564"  # ["AllBlocksCleared"]],
    "00"  # 0]
)


def test_the_array_form_is_the_golden_bytes_and_round_trips():
    assert encode_batch(EVENTS, 1.5, 0, form="array") == ARRAY_GOLDEN
    assert decode_batch(ARRAY_GOLDEN) == EventBatch(1.5, tuple(EVENTS), 0)
    hybrid = encode_batch(HYBRID, 1.5, 0, form="array")
    first = msgpack.unpackb(hybrid)[1][0]
    assert first[8:] == [None, 0, "sliding_window", 4]  # extra_keys None, then the group fields
    assert decode_batch(hybrid) == EventBatch(1.5, tuple(HYBRID), 0)
    with pytest.raises(ValueError, match="form"):
        encode_batch(EVENTS, 1.5, 0, form="json")


# vLLM 0.32's own event structs, declared array_like (the positional form): its decoder reads
# our array batches, and what its encoder writes for the decoded events our decoder reads back
VLLM_ARRAY = """
import sys, json, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
class S(BlockStored, array_like=True, tag="BlockStored"): pass
class R(BlockRemoved, array_like=True, tag="BlockRemoved"): pass
class C(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"): pass
class Batch(EventBatch):
    events: list[S | R | C]
batch = msgspec.msgpack.Decoder(Batch).decode(sys.stdin.buffer.read())
fields = [[type(e).__name__] + [getattr(e, f) for f in e.__struct_fields__] for e in batch.events]
hexed = lambda v: v.hex() if isinstance(v, bytes) else [hexed(x) for x in v] if isinstance(
    v, list) else v
print("RESULT " + json.dumps([hexed(f) for f in fields]))
print("BYTES " + msgspec.msgpack.encode(batch).hex())
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM installed")
def test_vllms_array_like_structs_read_our_array_form_and_we_read_theirs():
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    events = [
        BlockStored((h1, h2), None, tuple(range(8)), 4, "CPU"),
        BlockStored((h2,), h1, (8, 9, 10, 11), 4, "CPU", 1, "sliding_window", 6),
        BlockRemoved((h2, h1), "CPU", 0),
        BlockRemoved((h1,), "CPU"),
        AllBlocksCleared(),
    ]
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_ARRAY],
        input=encode_batch(events, 3.0, 0, form="array"),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    lines = run.stdout.decode().splitlines()
    fields = json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT ") :])
    assert (
        fields[0] == ["S", [h1.hex(), h2.hex()], None, list(range(8)), 4, None, "CPU"] + [None] * 8
    )
    assert fields[1][:8] == ["S", [h2.hex()], h1.hex(), [8, 9, 10, 11], 4, None, "CPU", None]
    assert fields[1][8:12] == [None, 1, "sliding_window", 6]
    assert fields[2][:4] == ["R", [h2.hex(), h1.hex()], "CPU", 0]
    assert fields[3][:4] == ["R", [h1.hex()], "CPU", None]
    assert fields[4] == ["C"]
    theirs = bytes.fromhex(next(x for x in lines if x.startswith("BYTES "))[len("BYTES ") :])
    assert msgpack.unpackb(theirs)[1][0][0] == "BlockStored"  # arrays, vLLM's tags
    assert decode_batch(theirs) == EventBatch(3.0, tuple(events), 0)
