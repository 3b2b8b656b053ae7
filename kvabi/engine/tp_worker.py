"""A worker rank of tensor parallelism (rank >= 1; tp_group.py starts it):

    python -m kvabi.engine.tp_worker --model M --dtype fp32 --rank 1 --size 2 --port P

It loads the model, keeps its shard (kvabi/parallel/tp_shard.py), checks with rank 0 that
they agree (model fingerprint, plan, dtype), builds its KV cache from rank 0's engine config
(the same block count, no tiers), then runs each step rank 0 broadcasts until told to stop.
Between steps it sends rank 0 its heads of whole blocks, or writes the heads rank 0 sends it
(tier entries and prefill/decode transfers are whole: kvabi/engine/tp_storage.py). It exits
when rank 0 goes (a collective fails or times out), never waits forever.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.kv_storage import KVStorage
from kvabi.engine.engine import LLMEngine
from kvabi.engine.tp_group import TPBlocks, TPSetup, TPStep, agreement, init_group
from kvabi.engine.tp_shm import ShmAllReduce, shm_path
from kvabi.models.registry import load_model
from kvabi.parallel.tp_shard import llama_plan, shard_llama

log = logging.getLogger("kvabi.tp_worker")


class Reducer:
    """This rank's all-reduce: shared memory once rank 0 named its file, else gloo."""

    def __init__(self) -> None:
        self.shm: ShmAllReduce | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm(tensor)
        dist.all_reduce(tensor)
        return tensor


def _recv() -> object:
    box: list[object] = [None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def serve(args: argparse.Namespace) -> int:
    from kvabi.engine.llm import model_fingerprint

    torch.set_num_threads(args.threads)
    init_group(args.rank, args.size, args.port, args.timeout)
    full = load_model(args.model or None, args.dtype, progress=False)
    plan = llama_plan(full, args.size)
    reduce = Reducer()
    shard = shard_llama(full, plan, args.rank, reduce)
    mine = agreement(model_fingerprint(args.model or None, full), plan, args.dtype)
    dist.all_gather_object([None] * args.size, mine)
    del full
    setup = _recv()
    if not isinstance(setup, TPSetup):
        log.error("tp rank %d: rank 0 refused the group: %s", args.rank, setup)
        return 2
    parent = os.getppid()
    reduce.shm = ShmAllReduce(shm_path(setup.shm_tag), args.rank, args.size, args.timeout)
    reduce.shm.alive = lambda: os.getppid() == parent  # rank 0 started this process
    engine = LLMEngine(shard, setup.config, "tp-worker")
    runner, storages = engine.runner, engine.cache.storages
    while True:
        step = _recv()
        if step is None:
            return 0
        if isinstance(step, TPBlocks):
            move_blocks(storages[step.pool_id], step)
            continue
        assert isinstance(step, TPStep), type(step)
        for pool_id, srcs, dsts in step.copies:
            storages[pool_id].copy_blocks(list(srcs), list(dsts))
        with torch.inference_mode(), runner.attention.step(step.ctxs, None):
            runner.model.hidden_states(step.ids, step.positions, runner.attention)


def move_blocks(storage: KVStorage, message: TPBlocks) -> None:
    """Send rank 0 this rank's heads of the blocks (tensor by tensor, in key order), or
    receive and write them."""
    ids = list(message.block_ids)
    if message.gather:
        blocks = storage.read_blocks(ids)
        for key in sorted(blocks.tensors):
            dist.send(blocks.tensors[key].contiguous(), 0)
        return
    blocks = CacheBuffers.empty(storage.desc, len(ids))
    for key in sorted(blocks.tensors):
        dist.recv(blocks.tensors[key], 0)
    storage.write_blocks(blocks, ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    try:
        return serve(args)
    except Exception:  # rank 0 gone or broken: leave, loudly
        log.exception("tp rank %d stops", args.rank)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
