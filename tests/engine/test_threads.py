"""torch's threads from the cores the process owns (kvabi/engine/threads.py), in a child
process pinned to one core: capped to 1, and never raised above a smaller setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import os, torch
from kvabi.engine.threads import fit_threads
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(2)
print(fit_threads(), torch.get_num_threads())
torch.set_num_threads(1)
print(fit_threads())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_process_pinned_to_one_core_runs_one_thread() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "1"]
