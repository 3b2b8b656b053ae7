"""The marks of every test that runs LMCache's own code, and the way to run it."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
ORACLE = Path(__file__).with_name("lmcache_oracle.py")

LMCACHE_MARKS = [
    pytest.mark.lmcache,
    pytest.mark.skipif(
        not LMCACHE_PYTHON.exists(),
        reason="LMCache is not installed: scripts/setup_lmcache.sh creates .venv-lmcache",
    ),
]


def run_oracle(*args: str, cwd: Path) -> None:
    """Run tests/interop/lmcache_oracle.py in .venv-lmcache; fail the test on its error."""
    done = subprocess.run([str(LMCACHE_PYTHON), str(ORACLE), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
