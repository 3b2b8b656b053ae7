"""Torch's threads from the cores this process owns.

torch sizes its OpenMP pool from the machine's cores, not the process's: a process pinned to
one core (taskset, a container's cpuset, a second kvabi process on shared cores) still runs two
threads on it, and each parallel loop then waits on the descheduled one (measured: a loop of 30
layer copies took 230 ms instead of 1.5 ms). `fit_threads` caps the pool at the cores in the
process's affinity mask; it never raises a smaller setting (OMP_NUM_THREADS, an explicit
`torch.set_num_threads`).
"""

from __future__ import annotations

import os

import torch


def owned_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fit_threads() -> int:
    """Cap torch's threads at the owned cores; return the count in use."""
    if torch.get_num_threads() > owned_cores():
        torch.set_num_threads(owned_cores())
    return torch.get_num_threads()
