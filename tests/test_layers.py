"""The package layers import only the layers below them (docs/ARCHITECTURE.md)."""

import ast
from pathlib import Path

LAYERS = [
    "abi",
    "wire",
    "interop",
    "cache",
    "connectors",
    "models",
    "engine",
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
