"""vLLM's own reader of the DeepSeek V3.2 indexer cache reads kvabi's sidecar blocks.

`fp8_paged_mqa_logits_torch` (vLLM `v1/attention/ops/rocm_aiter_mla_sparse.py`, its torch
reference of DeepGEMM's paged indexer logits) takes the cache as `[num_blocks, block_size,
D + 4]` u8 and reads each block as `block_size * D` fp8 codes then `block_size` f32 scales.
Given kvabi's `encode_blocks` bytes through a shuffled block table, its logits
`scale_t * sum_h w_h relu(code_t . q_h)` must equal those from kvabi's decoded keys (the scales
are powers of two, so the two orders of scaling round alike up to summation order).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvabi.abi.indexer_record import decode_blocks, encode_blocks
from kvabi.connectors.vllm_handoff import VLLM_PYTHON

DIM, BLOCK, HEADS, TOKENS = 128, 4, 8, 14
VLLM_LOGITS = """
import sys, torch
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch
job = torch.load(sys.argv[1])
logits = fp8_paged_mqa_logits_torch(
    job["q"], job["cache"], job["weights"], job["lens"], job["table"], job["max_len"]
)
torch.save(logits, sys.argv[2])
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm with vLLM installed")
def test_vllms_indexer_reader_reads_our_blocks(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(TOKENS, DIM, generator=g) * torch.rand(TOKENS, 1, generator=g) * 8
    blocks = encode_blocks(keys, BLOCK)  # [4, 4 * 132]: the sequence's blocks 0..3
    table = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)  # pool blocks of blocks 0..3
    pool = torch.zeros(6, BLOCK * (DIM + 4), dtype=torch.uint8)
    pool[table[0].long()] = blocks
    q = torch.randn(1, 1, HEADS, DIM, generator=g)
    weights = torch.randn(1, HEADS, generator=g)
    job = {
        "q": q,
        "cache": pool.view(6, BLOCK, DIM + 4),
        "weights": weights,
        "lens": torch.tensor([TOKENS], dtype=torch.int32),
        "table": table,
        "max_len": 16,
    }
    torch.save(job, tmp_path / "job.pt")
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_LOGITS, str(tmp_path / "job.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    got = torch.load(tmp_path / "out.pt")[0]  # [max_len]
    decoded = decode_blocks(blocks, DIM)[:TOKENS]  # [T, D]
    want = (torch.relu(decoded @ q[0, 0].T) * weights[0]).sum(-1)  # [T]
    torch.testing.assert_close(got[:TOKENS], want, rtol=1e-5, atol=1e-5)
    assert torch.isinf(got[TOKENS:]).all()
    assert (want.abs() > 1.0).sum() > TOKENS // 2  # values large enough to tell layouts apart
