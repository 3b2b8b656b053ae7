"""Markers of the interop tests."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM process from .venv-vllm (scripts/setup_vllm.sh)"
    )
