"""The package layers import only the layers below them (docs/ARCHITECTURE.md)."""

import ast
from pathlib import Path

LAYERS = [
    "native",
    "abi",
    "wire",
    "cache",
    "interop",
    "models",
    "parallel",
    "engine",
    "connectors",
    "transfer",
    "routing",
    "disagg",
    "server",
    "bench",
    "cli",
]
ROOT = Path(__file__).resolve().parents[1] / "kvabi"


def _imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvabi" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


def test_every_module_belongs_to_a_layer():
    for path in ROOT.iterdir():
        if path.is_dir() and not path.name.startswith("__"):
            assert path.name in LAYERS, f"kvabi/{path.name} is not in the layer list"


def test_layers_import_only_lower_layers():
    bad = []
    for rank, layer in enumerate(LAYERS):
        for path in (ROOT / layer).rglob("*.py"):
            for used in _imported_layers(path):
                if LAYERS.index(used) > rank:
                    bad.append(f"{path.relative_to(ROOT)} imports kvabi.{used}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_the_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from kvabi.engine import thing\nimport kvabi.wire.container\n")
    assert _imported_layers(bad) == {"engine", "wire"}


# What only the KV cache's owner (kvabi/cache) and its one user (kvabi/engine) may touch: the
# block pool with its index of cached blocks, and the KV storage. Everyone else goes through
# `KVCache`'s block API (hasher, held, export, export_layer, import_blocks).
CACHE_INTERNALS = {"pool", "storage", "cached_block", "cache_block"}
INTERNAL_MODULES = {"kvabi.cache.block_pool", "kvabi.cache.kv_storage"}


def _touches_cache_internals(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in CACHE_INTERNALS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in INTERNAL_MODULES:
            found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name in INTERNAL_MODULES]
    return found


def test_only_cache_and_engine_touch_the_pool_storage_and_index():
    bad = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] not in ("cache", "engine"):
            bad += [f"{path.relative_to(ROOT)} {f}" for f in _touches_cache_internals(path)]
    assert not bad, "reaches into the KV cache:\n" + "\n".join(bad)


def test_the_internals_check_catches_a_back_door(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text(
        "from kvabi.cache.block_pool import BlockPool\nengine.cache.pool.allocate(1)\n"
        "e.cache.storage.k\n"
    )
    assert len(_touches_cache_internals(bad)) == 3
