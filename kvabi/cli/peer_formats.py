"""Peers' own KV formats that `kvabi inspect` and `kvabi convert` recognise beside containers.

Each format is a detector (does this path hold it?) with its inspect and convert commands;
`detect_peer_format` asks each in turn. A container is what none of them claims.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvabi.cli import lmcache_blob_cli, vllm_offload_cli


@dataclass(frozen=True)
class PeerFormat:
    """One peer format: its detector, and `inspect` / `convert` (from it) commands."""

    name: str
    detect: Callable[[Path], bool]
    inspect: Callable[[argparse.Namespace], int]
    convert_from: Callable[[argparse.Namespace], int]


PEER_FORMATS = (
    PeerFormat(
        vllm_offload_cli.FORMAT,
        vllm_offload_cli.is_vllm_offload,
        vllm_offload_cli.cmd_inspect,
        vllm_offload_cli.cmd_convert_from,
    ),
    PeerFormat(
        lmcache_blob_cli.FORMAT,
        lmcache_blob_cli.is_lmcache_blob,
        lmcache_blob_cli.cmd_inspect,
        lmcache_blob_cli.cmd_convert_from,
    ),
)


def detect_peer_format(path: str | Path) -> PeerFormat | None:
    """The peer format `path` holds, or None (then it is read as a kvabi container)."""
    return next((f for f in PEER_FORMATS if f.detect(Path(path))), None)
