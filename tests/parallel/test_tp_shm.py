"""The shared-memory all-reduce between real processes: every rank gets the sum in rank order,
bit-identical across ranks, over many rounds (both buffers reused) in fp32 and bf16; a rank
that never arrives makes the others raise ShmTimeout at their deadline, and a peer reported
gone makes them raise at once."""

from __future__ import annotations

import io
import multiprocessing as mp
import time

import pytest
import torch

from kvabi.engine.tp_shm import ShmAllReduce, ShmTimeout, shm_path


def _rank(tag: str, rank: int, size: int, rounds: int, out) -> None:
    shm = ShmAllReduce(shm_path(tag), rank, size, timeout_s=20)
    results = []
    for k in range(rounds):
        dtype = torch.float32 if k % 3 else torch.bfloat16
        g = torch.Generator().manual_seed(1000 * k + rank)
        t = torch.randn(5 + k % 7, 64, generator=g).to(dtype)
        results.append(shm(t).clone())
    buf = io.BytesIO()
    torch.save(results, buf)  # bytes: a tensor through a queue would share a file descriptor
    out.put((rank, buf.getvalue()))
    shm.close()


def _expected(rank_count: int, rounds: int) -> list[torch.Tensor]:
    want = []
    for k in range(rounds):
        dtype = torch.float32 if k % 3 else torch.bfloat16
        parts = []
        for r in range(rank_count):
            g = torch.Generator().manual_seed(1000 * k + r)
            parts.append(torch.randn(5 + k % 7, 64, generator=g).to(dtype))
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        want.append(total)
    return want


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_sum(size: int) -> None:
    ctx = mp.get_context("spawn")
    tag = f"test-{size}-{time.monotonic_ns()}"
    own = ShmAllReduce.create(tag, size, timeout_s=20)
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(tag, r, size, 40, out)) for r in range(1, size)]
    try:
        for p in procs:
            p.start()
        mine = []
        for k in range(40):
            dtype = torch.float32 if k % 3 else torch.bfloat16
            g = torch.Generator().manual_seed(1000 * k)
            mine.append(own(torch.randn(5 + k % 7, 64, generator=g).to(dtype)).clone())
            if k == 0:  # every rank has mapped it: the name is gone, the memory is not
                assert not shm_path(tag).exists()
        theirs = {}
        for _ in procs:
            rank, data = out.get(timeout=60)
            theirs[rank] = torch.load(io.BytesIO(data))
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        own.close(unlink=True)
    want = _expected(size, 40)
    for k in range(40):
        assert torch.equal(mine[k], want[k])
        for r in range(1, size):
            assert torch.equal(theirs[r][k], mine[k])


def test_a_missing_rank_times_out_and_a_gone_one_fails_at_once() -> None:
    tag = f"test-timeout-{time.monotonic_ns()}"
    shm = ShmAllReduce.create(tag, 2, timeout_s=0.5)
    assert shm_path(tag).exists()  # no round completed: the peer has not attached yet
    start = time.monotonic()
    with pytest.raises(ShmTimeout, match="no rank reached"):
        shm(torch.ones(4))
    assert time.monotonic() - start < 5
    shm.alive = lambda: False
    start = time.monotonic()
    with pytest.raises(ShmTimeout, match="gone"):
        shm(torch.ones(4))
    assert time.monotonic() - start < 0.5
    shm.close(unlink=True)
    assert not shm_path(tag).exists()
