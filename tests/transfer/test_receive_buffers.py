"""`ReceiveBuffers`: a buffer is handed out again only once no tensor views it."""

from __future__ import annotations

import numpy as np
import torch

from kvabi.transfer.receive_buffers import ReceiveBuffers


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def test_a_free_buffer_is_reused_and_one_in_use_never_is():
    buffers = ReceiveBuffers(max_buffers=2)
    first = buffers.take(1000)
    base = _address(first)
    tensor = torch.frombuffer(first[64:128], dtype=torch.float32)  # a payload's view
    del first
    second = buffers.take(1000)  # the first is still viewed by `tensor`
    other = _address(second)
    assert other != base and buffers.num_kept == 2
    del second
    third = buffers.take(900)  # the second is free again and large enough
    assert _address(third) == other and len(third) == 900
    del third, tensor
    assert _address(buffers.take(1000)) == base  # the tensor is gone: reused
    assert buffers.num_kept == 2


def test_past_the_limits_buffers_are_not_kept():
    buffers = ReceiveBuffers(max_buffers=1, max_bytes=100)
    big = buffers.take(101)
    assert len(big) == 101 and buffers.num_kept == 0
    held = buffers.take(50)
    other = buffers.take(50)  # the one kept buffer is in use and there is no room: not kept
    assert _address(held) != _address(other) and buffers.num_kept == 1
