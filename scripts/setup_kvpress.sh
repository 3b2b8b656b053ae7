#!/usr/bin/env bash
# Creates .venv-kvpress: NVIDIA kvpress 0.5.5 in its own virtual env (it pins transformers
# < 5.3; the project's .venv has 5.24), as the oracle of kvabi's token-eviction presses
# (tests/engine/test_press_kvpress.py, which skips without it; kvabi/bench/kvpress_worker.py
# runs in it). torch==2.13.0 first (the local CPU wheel), then kvpress's own dependencies
# except the ones its press code never imports on the CPU (datasets, peft, fire, pandas...,
# left out with --no-deps). ~1 minute, ~1 GB. Idempotent: a finished install leaves
# .venv-kvpress/.installed.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-kvpress
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"

fail() {
  echo "setup_kvpress: FAILED: $*" >&2
  exit 1
}

check_imports() {
  (cd / && "$OLDPWD/$PY" - <<'PY'
from kvpress import SnapKVPress, StreamingLLMPress
import transformers
assert SnapKVPress(compression_ratio=0.5).window_size == 64
print(transformers.__version__)
PY
  ) >"$VENV/import-check.log" 2>&1
}

if [[ -f "$VENV/.installed" ]]; then
  echo "setup_kvpress: $VENV already installed ($(cat "$VENV/.installed")); nothing to do"
  exit 0
fi

command -v python3.11 >/dev/null || fail "python3.11 not found on PATH"
echo "setup_kvpress: creating $VENV (python3.11)"
python3.11 -m venv "$VENV" || fail "python3.11 -m venv $VENV"
"$PIP" install -q --upgrade pip || fail "upgrading pip in $VENV"
echo "setup_kvpress: pip install torch==2.13.0 (CPU wheel)"
"$PIP" install -q torch==2.13.0 || fail "pip install torch==2.13.0"
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null \
  || fail "torch in $VENV is a CUDA build; expected the CPU wheel"
echo "setup_kvpress: pip install kvpress==0.5.5 (torch stays the CPU wheel)"
"$PIP" install -q kvpress==0.5.5 || fail "pip install kvpress==0.5.5"
echo "setup_kvpress: checking that kvpress's presses import"
check_imports || fail "kvpress did not import; see $VENV/import-check.log"
version=$("$PY" -c "import importlib.metadata as m; print(m.version('kvpress'), m.version('transformers'))")
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
echo "kvpress/transformers $version, torch $torch_version" >"$VENV/.installed"
echo "setup_kvpress: done: kvpress/transformers $version, torch $torch_version in $VENV"
