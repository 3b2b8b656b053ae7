"""`kvabi bench windows` on a tiny random Gemma 3 (window 4): the groups hold less than every
token in every layer would, the figures are written as one JSON object with `*_ratio` names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvabi.bench import memory_bench
from kvabi.bench.window_bench import run
from tests.models.hf_reference import randomize
from tests.models.test_gemma3 import COMMON, CONFIGS
from tests.models.test_registry import _write_tokenizer as write_tokenizer

transformers = pytest.importorskip("transformers")


def tiny_gemma3(path: Path, max_len: int = 1024) -> Path:
    config = transformers.Gemma3TextConfig(
        **{**COMMON, "max_position_embeddings": max_len}, **CONFIGS["default-pattern"]
    )
    randomize(transformers.Gemma3ForCausalLM(config)).save_pretrained(path)
    write_tokenizer(path)
    return path


def test_groups_hold_less_than_every_layer_would(tmp_path: Path) -> None:
    tiny_gemma3(tmp_path)
    out = tmp_path / "windows.json"
    figures = run(True, str(out), str(tmp_path), sizes=(2, 200, 40))
    assert json.loads(out.read_text()) == json.loads(json.dumps(figures))
    # the full group has one layer, so the 5 sliding ones are 5 groups of one (one pool)
    assert figures["groups"] == [[1, 4]] * 5 + [[1, 0]]
    # decoding 40 tokens past a 200-token prompt, the sliding group keeps about 2 blocks of 16
    # where a windowless cache keeps all 13 to 15: held ~ (5 * 2 + 15) / (6 * 15) of it
    assert figures["windowless_vs_held_ratio"] > 2.5
    assert figures["peak_windowless_vs_held_ratio"] >= 1.0
    assert figures["held_peak_bytes"] > 0


def test_bench_memory_measures_a_windowed_model_by_its_groups(tmp_path: Path) -> None:
    """`kvabi bench memory --model M`: a model with sliding layers gets the windows figures,
    one without gets paged against contiguous."""
    from tests.server.tiny_server import tiny_folder

    # --quick's size: 4 prompts of 2,048 tokens
    windowed = memory_bench.run(True, None, str(tiny_gemma3(tmp_path / "gemma3", 4096)))
    assert windowed["groups"][-1] == [1, 0] and windowed["windowless_vs_held_ratio"] > 1.0
    plain = memory_bench.run(True, None, str(tiny_folder(tmp_path / "llama")))
    assert "windowless_vs_held_ratio" not in plain
    assert 0.5 < plain["paged_utilisation_ratio"] <= 1.0
