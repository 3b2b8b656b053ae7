"""LMCache's own detect_format classifies each preset's tensors as kvabi's table says."""

import json

from kvabi.abi.descriptor import MLA, LayerSpec, ModelSpec
from kvabi.abi.presets import PRESETS, preset_descriptor
from kvabi.interop.lmcache_formats import LMCACHE_FORMATS, engine_tensor_shapes
from tests.interop.lmcache_marks import LMCACHE_MARKS, run_oracle

# 4 KV heads: with 2, LMCache's shapes collide (LMCache #4463/#4467); 3 blocks, 2 layers.
ATTN_MODEL = ModelSpec(layers=(LayerSpec(num_kv_heads=4, k_dim=8, v_dim=8),) * 2)
MLA_MODEL = ModelSpec(layers=(LayerSpec(MLA, latent_dim=512, rope_dim=64),) * 2)
NEST = {"pool": "tensor", "kv_slots": "kv_lists"}


def _case(row) -> dict:
    model = MLA_MODEL if PRESETS[row.preset].kind == MLA else ATTN_MODEL
    shapes = engine_tensor_shapes(row, preset_descriptor(row.preset, model), 3)
    return {"name": row.preset, "engine": row.engine, "kv_layout": row.kv_layout,
            "nest": NEST.get(row.form, "list"), "shapes": shapes}  # fmt: skip


def test_table_names_known_presets_once():
    names = [row.preset for row in LMCACHE_FORMATS]
    assert len(names) == len(set(names)) and set(names) <= set(PRESETS)


def test_engine_shapes():
    by_name = {row.preset: row for row in LMCACHE_FORMATS}
    attn = preset_descriptor("vllm-lbnhc", ATTN_MODEL)
    assert engine_tensor_shapes(by_name["vllm-lbnhc"], attn, 3) == [[3, 16, 4, 16]] * 2
    mha = preset_descriptor("sglang-mha", ATTN_MODEL)
    assert engine_tensor_shapes(by_name["sglang-mha"], mha, 3) == [[3, 4, 8]] * 4


def test_lmcache_detect_format_agrees(tmp_path):
    (tmp_path / "cases.json").write_text(json.dumps([_case(r) for r in LMCACHE_FORMATS]))
    run_oracle("detect", str(tmp_path / "cases.json"), str(tmp_path / "out.json"), cwd=tmp_path)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got == {row.preset: row.engine_kv_format for row in LMCACHE_FORMATS}


for _mark in LMCACHE_MARKS:
    test_lmcache_detect_format_agrees = _mark(test_lmcache_detect_format_agrees)
