"""A real `kvabi prefill-worker` process (HF or llama.cpp prefilling) on a free local port."""

from __future__ import annotations

import subprocess
import sys
import time

from kvabi.server.launch import ServerProcess
from tests.disagg.processes import ENV, _port

READY = "serving KV on "


class WorkerProcess(ServerProcess):
    """`kvabi prefill-worker --engine ENGINE ARGS`; ready once it prints its serving line
    (no HTTP: `stop` and `output` are the server's)."""

    def __init__(self, engine: str, *args: str, startup_timeout_s: float = 180.0) -> None:
        self.kv_address = f"127.0.0.1:{_port()}"
        super().__init__(["--engine", engine, "--kv-address", self.kv_address, *args], env=ENV)
        self.startup_timeout_s = startup_timeout_s

    def start(self) -> WorkerProcess:
        command = [sys.executable, "-m", "kvabi.cli.main", "prefill-worker", *self.args]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        return self

    def _poll_health(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while READY + self.kv_address not in self.output(1 << 20):
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"prefill-worker exited during start-up:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill-worker not ready in {self.startup_timeout_s} s")
            time.sleep(0.2)
