"""Tier entries under tensor parallelism, over real processes: rank 0 gathers every rank's heads
of a block before it is written down, and scatters each rank its heads of a block it loads
(kvabi/engine/tp_storage.py), so a disk tier written at one TP size is read at any other.
SmolLM2 (3 KV heads: 2 + 1 at TP 2, 1 + 1 + 1 at TP 3) in fp32, greedy tokens equal to TP 1
without tiers; the prompts' blocks come from the disk tier (counted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvabi.abi.buffers import CacheBuffers
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from tests.parallel.test_tp_processes import MODEL, PARAMS, PROMPTS

pytestmark = pytest.mark.slow
BLOCK = 16
FILLER = [f"Unrelated filler text number {i}, to take the pool's blocks. " * 6 for i in range(4)]
SHORT = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def tp_llm(size: int, folder: Path) -> LLM:
    """An engine at TP `size` over a disk tier in `folder`, with a pool of 24 blocks (fillers
    push the prompts' blocks down to the disk)."""
    tiers = TierConfig(disk_dir=str(folder))
    return LLM(
        MODEL, dtype="fp32", progress=False, tensor_parallel_size=size, tiers=tiers,
        num_blocks=24, block_size=BLOCK,
    )  # fmt: skip


def full_block_tokens(llm: LLM) -> int:
    tokenizer = llm.engine.tokenizer
    return sum(len(tokenizer.encode(p)) // BLOCK * BLOCK for p in PROMPTS)


def write_down(llm: LLM) -> list[list[int]]:
    """The prompts' greedy tokens, then fillers that evict their blocks to the disk, then the
    prompts again, loaded back from the disk: their tokens (asserted the same)."""
    first = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]
    llm.generate(FILLER, SHORT)
    stats = llm.engine.cache_stats()
    assert stats["tier_disk_writes"] > 0 and stats["tier_write_errors"] == 0
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert again == first
    assert llm.engine.cache_stats()["tier_disk_hit_tokens"] > 0  # its own entries, back
    return first


def read_back(size: int, folder: Path, want: list[list[int]]) -> None:
    """A fresh engine at TP `size` finds every prompt's full blocks on the disk."""
    llm = tp_llm(size, folder)
    try:
        got = [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in PROMPTS]
        assert got == want
        stats = llm.engine.cache_stats()
        assert stats["tier_disk_hit_tokens"] == full_block_tokens(llm) > 0
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], Path]:
    """TP 1's greedy tokens (the reference), and a disk tier it wrote them down to."""
    folder = tmp_path_factory.mktemp("tp1-disk")
    llm = tp_llm(1, folder)
    try:
        return write_down(llm), folder
    finally:
        llm.engine.close()


def test_entries_written_at_tp1_load_at_tp2(tp1) -> None:
    want, folder = tp1
    read_back(2, folder, want)


def test_entries_written_at_tp2_load_at_tp1(tmp_path: Path, tp1) -> None:
    want, _ = tp1
    llm = tp_llm(2, tmp_path)
    try:
        assert write_down(llm) == want
        check_scatter_and_gather(llm)
    finally:
        llm.engine.close()
    read_back(1, tmp_path, want)


def check_scatter_and_gather(llm: LLM) -> None:
    """Rank 0 writes whole blocks of random K/V: it keeps its heads (0 and 1 of 3) and the
    worker rank the third; reading them back gathers the same bytes."""
    storage = llm.engine.cache.storage
    whole = CacheBuffers.empty(storage.entry_desc, 3)
    torch.manual_seed(0)
    for t in whole.tensors.values():
        t.copy_(torch.randn(t.shape))
    ids = [5, 2, 9]  # free: the prompts' blocks went to the disk, the fillers' few are cached
    storage.write_blocks(whole, ids)
    back = storage.read_blocks(ids)
    for key, t in whole.tensors.items():
        assert torch.equal(back.tensors[key], t)
        k_heads = storage.k[int(key)][ids]  # rank 0's K: [3 blocks, 16 slots, 2 heads, 64]
        assert torch.equal(k_heads, t[0][:, :, :2])  # vllm-flash-attn: [2, B, N, H, C]
    assert llm.engine.tp.move_s > 0
