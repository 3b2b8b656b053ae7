"""NVIDIA kvpress 0.5.5 as the oracle of kvabi's presses (kvabi/engine/press.py): runs in
.venv-kvpress (scripts/setup_kvpress.sh), not in kvabi's environment, on an HF model folder.

For each case (a prompt, a press, the question's length, tokens to generate) it does what
kvpress's pipeline does (`KVPressTextGenerationPipeline._forward` and `generate_answer`): the
context prefilled under `with press(model)` into a `DynamicCache`, then the question at its own
positions over the compressed cache, then greedy tokens. It records, per layer, the indices each
press kept (`ScorerPress.compress`'s `scores.topk(n_kept)`, by wrapping `score`), and prints one
JSON object: per case `{"kept": {layer: [[index, ...] per KV head]}, "tokens": [...]}`.

    .venv-kvpress/bin/python kvabi/bench/kvpress_worker.py CASES.json
    CASES.json: {"model": FOLDER, "cases": [{"prompt": [...], "press": "snapkv", "ratio": 0.5,
                 "window": 64, "kernel": 5, "sinks": 4, "question": 8, "max_tokens": 8}]}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from kvpress import SnapKVPress, StreamingLLMPress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept
from transformers import AutoModelForCausalLM, DynamicCache


def make_press(case: dict) -> ScorerPress:
    if case["press"] == "streaming":
        return StreamingLLMPress(compression_ratio=case["ratio"], n_sink=case["sinks"])
    return SnapKVPress(
        compression_ratio=case["ratio"], window_size=case["window"], kernel_size=case["kernel"]
    )


def run_case(model, case: dict) -> dict:
    press, kept = make_press(case), {}
    score = press.score

    def recording_score(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n = compute_n_kept(keys.shape[2], press.compression_ratio)
        kept[module.layer_idx] = scores.topk(n, dim=-1).indices[0].tolist()  # as compress
        return scores

    press.score = recording_score
    ids = torch.tensor([case["prompt"]])
    context_len = ids.shape[1] - case["question"]
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids[:, :context_len], past_key_values=cache)
    with torch.no_grad():
        positions = torch.arange(context_len, ids.shape[1])[None]
        logits = model(input_ids=ids[:, context_len:], past_key_values=cache,
                       position_ids=positions).logits  # fmt: skip
        tokens = [int(logits[0, -1].argmax())]
        position = ids.shape[1]
        for _ in range(case["max_tokens"] - 1):
            step = torch.tensor([[tokens[-1]]])
            logits = model(input_ids=step, past_key_values=cache,
                           position_ids=torch.tensor([[position]])).logits  # fmt: skip
            tokens.append(int(logits[0, -1].argmax()))
            position += 1
    return {"kept": kept, "tokens": tokens}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    print(json.dumps({"cases": [run_case(model, c) for c in spec["cases"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
