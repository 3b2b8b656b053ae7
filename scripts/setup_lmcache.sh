#!/usr/bin/env bash
# Creates .venv-lmcache: LMCache 0.5.6 in its own virtual env, for the interop tests that run
# LMCache's own EncodedKV codec and layout detector (tests/interop/test_lmcache_*.py, which
# skip without it). lmcache's wheel declares CUDA packages (cupy-cuda13x, cuda-python,
# cufile-python, nvtx) and service clients it never imports on the CPU paths we use, so it is
# installed with --no-deps, after torch==2.13.0 (the local CPU wheel), with the few modules
# `lmcache.v1.kv_codec` and `lmcache.v1.gpu_connector.kv_format` import. ~1 minute, ~1.3 GB.
# Idempotent: a finished install leaves .venv-lmcache/.installed.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-lmcache
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
# What LMCache's codec and detector import (found by importing them); pins from its metadata.
DEPS=('numpy<=2.2.6' numba cachetools pyyaml requests 'prometheus_client<=0.24.1' py-cpuinfo
  psutil aiohttp sortedcontainers)

fail() {
  echo "setup_lmcache: FAILED: $*" >&2
  exit 1
}

check_imports() {
  # Run outside the package folder: lmcache/logging.py would shadow the standard library's.
  (cd / && "$OLDPWD/$PY" - <<'PY'
import torch
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector.kv_format import detect_format
from lmcache.v1.kv_codec.encoded_kv import CODEC_MAGIC, deserialize_header

assert CODEC_MAGIC == b"LMCKV\x01\x00\x01", CODEC_MAGIC
kv = [torch.zeros(2, 3, 16, 4, 8) for _ in range(2)]
fmt, _ = detect_format(kv, EngineType.VLLM, {"kv_layout": "NHD"})
assert fmt.name == "NL_X_TWO_NB_BS_NH_HS", fmt
PY
  ) >"$VENV/import-check.log" 2>&1
}

if [[ -f "$VENV/.installed" ]]; then
  echo "setup_lmcache: $VENV already installed ($(cat "$VENV/.installed")); nothing to do"
  exit 0
fi

command -v python3.11 >/dev/null || fail "python3.11 not found on PATH"
echo "setup_lmcache: creating $VENV (python3.11)"
python3.11 -m venv "$VENV" || fail "python3.11 -m venv $VENV"
"$PIP" install -q --upgrade pip || fail "upgrading pip in $VENV"

echo "setup_lmcache: pip install torch==2.13.0 (CPU wheel)"
"$PIP" install -q torch==2.13.0 || fail "pip install torch==2.13.0"
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null \
  || fail "torch in $VENV is a CUDA build; expected the CPU wheel"

echo "setup_lmcache: pip install --no-deps lmcache==0.5.6, then its imported deps"
"$PIP" install -q --no-deps lmcache==0.5.6 || fail "pip install lmcache==0.5.6"
"$PIP" install -q "${DEPS[@]}" || fail "pip install ${DEPS[*]}"

echo "setup_lmcache: checking LMCache's EncodedKV codec and detect_format"
check_imports || fail "LMCache's codec or detector did not import; see $VENV/import-check.log"
version=$("$PY" -c "import importlib.metadata as m; print(m.version('lmcache'))")
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
echo "lmcache $version, torch $torch_version" >"$VENV/.installed"
echo "setup_lmcache: done: lmcache $version, torch $torch_version in $VENV"
