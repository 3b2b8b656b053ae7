"""The kernels' XXH3-64 (the ABI's checksum, written from xxHash's specification) against the
`xxhash` package, and the bulk checksums of tier entries against the one-entry Python path.

Built for each ISA target this CPU can run: the AVX-512 and AVX2 stripe loops and, where
neither applies, the scalar one differ; all must give the same digests."""

import numpy as np
import pytest
import xxhash

from kvabi.native.cpu_kernels import EntrySpans
from kvabi.wire.entries import _checksums, entry_checksums, entry_shape, write_entries
from tests.wire.test_entries import CASES, _keys, filled

RNG = np.random.default_rng(7)
DATA = RNG.integers(0, 256, 9000, dtype=np.uint8)


def test_every_length_through_several_blocks_is_xxhash(isa_kernels):
    # 0-16, 17-128, 129-240 bytes and the long path: whole blocks of 1024, a last block that
    # is full or one byte, and a last stripe that overlaps the block before
    for n in range(0, 3200):
        assert isa_kernels.xxh3_64(DATA[:n]) == xxhash.xxh3_64_intdigest(DATA[:n].tobytes()), n
    for n in (4096, 4097, 8191, 9000):
        assert isa_kernels.xxh3_64(DATA[:n]) == xxhash.xxh3_64_intdigest(DATA[:n].tobytes()), n
    zeros = np.zeros(368640, dtype=np.uint8)
    assert isa_kernels.xxh3_64(zeros) == xxhash.xxh3_64_intdigest(zeros.tobytes())


def test_a_section_sum_is_the_hash_of_its_header_then_payload_at_every_size(isa_kernels):
    rows = RNG.integers(0, 256, (3, 6000), dtype=np.uint8)
    sections = [(0, 100, length) for length in (0, 1, 200, 224, 225, 1008, 2032, 2033, 3000)]
    sections += [(5000, 16, 4000), (40, 40, 5)]  # a payload before its header; overlapping
    got = isa_kernels.entry_checksums(rows, EntrySpans.of(77, np.asarray(sections), 16), 2)
    for i, row in enumerate(rows):
        data = row.tobytes()
        want = [xxhash.xxh3_64_intdigest(data[:77])]
        want += [xxhash.xxh3_64_intdigest(data[h : h + 16] + data[p : p + n])
                 for h, p, n in sections]  # fmt: skip
        want.append(xxhash.xxh3_64_intdigest(np.asarray(want[1:], dtype="<u8").tobytes()))
        assert got[i].tolist() == want


@pytest.mark.parametrize("name", sorted(CASES))
def test_entry_checksums_are_the_one_entry_paths(isa_kernels, name, monkeypatch):
    desc = CASES[name]
    shape = entry_shape(desc)
    ids, hashes = _keys(desc)
    entries = write_entries(shape, filled(desc, len(hashes)), ids, hashes)
    rows = np.stack([np.frombuffer(e, dtype=np.uint8) for e in entries])
    want = np.stack([_checksums(shape, r) for r in rows])
    got = isa_kernels.entry_checksums(rows, shape.sum_spans, 2)
    assert np.array_equal(got, want)
    stored = np.ascontiguousarray(rows[:, shape.sums]).reshape(len(rows), -1).view("<u8")
    assert np.array_equal(stored, want)  # what the writer sealed them with
    monkeypatch.setattr("kvabi.wire.entries.cpu_kernels", lambda: None)
    assert np.array_equal(entry_checksums(shape, rows), want)


def test_a_section_outside_the_rows_is_refused(isa_kernels):
    rows = np.zeros((2, 100), dtype=np.uint8)
    for sections, meta in (([(0, 90, 11)], 10), ([(95, 0, 10)], 10), ([(0, 0, 10)], 101)):
        with pytest.raises(ValueError, match="outside"):
            isa_kernels.entry_checksums(rows, EntrySpans.of(meta, np.asarray(sections), 16), 1)


def test_a_files_sums_taken_as_it_is_read_are_the_entrys(isa_kernels, tmp_path):
    desc = CASES[sorted(CASES)[0]]
    shape = entry_shape(desc)
    ids, hashes = _keys(desc)
    entries = write_entries(shape, filled(desc, len(hashes)), ids, hashes)
    paths = []
    for i, entry in enumerate(entries):
        paths.append(tmp_path / f"{i}.kvabi")
        paths[-1].write_bytes(entry)
    paths[-1].write_bytes(bytes(entries[-1])[:-1])  # cut short: read, not summed
    rows = np.zeros((len(paths), shape.size), dtype=np.uint8)
    got, sums = isa_kernels.read_files([str(p) for p in paths], rows, 0, 2, shape.sum_spans)
    assert got == [shape.size] * (len(paths) - 1) + [shape.size - 1]
    want = np.stack([_checksums(shape, np.frombuffer(e, dtype=np.uint8)) for e in entries])
    assert np.array_equal(sums[:-1], want[:-1])
