"""The marks of every test that runs a real vLLM process."""

import pytest

from kvabi.connectors.vllm_handoff import VLLM_PYTHON

VLLM_MARKS = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason="vLLM is not installed: scripts/setup_vllm.sh creates .venv-vllm",
    ),
]
