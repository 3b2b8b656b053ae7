"""`RowArena`: a buffer is handed out again only once nothing refers to it, within its cap."""

import numpy as np
import torch

from kvabi.wire.row_arena import RowArena


def _base(rows: np.ndarray) -> int:
    return rows.__array_interface__["data"][0]


def test_a_buffer_comes_back_only_once_every_view_of_it_is_gone():
    arena = RowArena(1 << 20)
    rows = arena.rows(4, 100)
    first = _base(rows)
    tensor = torch.from_numpy(rows)[1:3].view(torch.int16)  # what a cache view holds
    entry = memoryview(rows[2])  # what a sealed entry is
    del rows
    other = arena.rows(4, 100)
    assert _base(other) != first  # still held by the tensor and the memoryview
    second = _base(other)
    del other, tensor
    assert _base(arena.rows(2, 100)) == second  # the first: still held by the memoryview
    del entry
    again = arena.rows(3, 100)
    assert _base(again) == first and arena.reused >= 1
    again[:] = 7  # writable
    assert again.shape == (3, 100) and again.flags.c_contiguous


def test_the_smallest_free_buffer_that_fits_is_taken():
    arena = RowArena(1 << 20)
    big, small = arena.rows(10, 100), arena.rows(2, 100)
    bases = _base(big), _base(small)
    del big, small
    assert _base(arena.rows(1, 150)) == bases[1]
    assert _base(arena.rows(5, 100)) == bases[0]


def test_past_its_cap_a_request_gets_fresh_memory_and_free_buffers_make_room():
    arena = RowArena(1000)
    held = arena.rows(6, 100)  # 600 of 1000 bytes
    fresh = arena.rows(5, 100)  # would pass the cap: not kept
    assert arena.held_bytes == 600 and _base(fresh) != _base(held)
    del held
    kept = arena.rows(9, 100)  # the free 600-byte buffer goes to make room for 900
    assert arena.held_bytes == 900 and kept.shape == (9, 100)
    assert arena.rows(0, 100).shape == (0, 100)
