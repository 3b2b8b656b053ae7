"""Running the server: in this process (`run_server`, what `kvabi serve` does) or as a child
process on a free local port (`ServerProcess`, for tests and `kvabi bench serve`)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType

import httpx

from kvabi.disagg.settings import DisaggSettings
from kvabi.engine.engine import LLMEngine
from kvabi.server.settings import ServerSettings


def run_server(
    engine: LLMEngine,
    settings: ServerSettings,
    host: str,
    port: int,
    log_level: str = "info",
    disagg: DisaggSettings | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM): uvicorn over `create_app`; kvabi's own log
    lines go to stderr at `log_level`, as uvicorn's do."""
    import uvicorn

    from kvabi.server.app import create_app
    from kvabi.server.http_limits import header_deadline_protocol

    log_to_stderr(log_level)
    uvicorn.run(
        create_app(engine, settings, disagg),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        http=header_deadline_protocol(settings.header_timeout_s),
    )


def log_to_stderr(level: str) -> None:
    """Show the `kvabi.*` loggers' records on stderr from `level` up, one line each."""
    logger = logging.getLogger("kvabi")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:  %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`kvabi serve ARGS` in a child process on a free port of 127.0.0.1; a context manager.

    Ready once /health answers 200; its output goes to a temporary log, shown if it fails.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> None:
        """`host`: the address it serves on (and is polled at); `prefix`: a command to run it
        under (e.g. `ip netns exec NAME`)."""
        self.args, self.startup_timeout_s = list(args), startup_timeout_s
        self.host, self.prefix = host, list(prefix)
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url`."""
        return f"{self.url}/v1"

    def __enter__(self) -> ServerProcess:
        if self.process is None:  # `with ServerProcess(...).start():` must not start a second
            self.start()
        return self.wait_ready()

    def start(self) -> ServerProcess:
        """Launch the process (it loads the model before it answers)."""
        command = [*self.prefix, sys.executable, "-m", "kvabi.cli.main", "serve"]
        command += ["--host", self.host, "--port", str(self.port)]
        self.process = subprocess.Popen(
            command + self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )

        return self

    def wait_ready(self) -> ServerProcess:
        """Wait until /health answers 200; stop the process and raise if it never does."""
        try:
            self._poll_health()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()

    def _poll_health(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"kvabi serve exited during start-up:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"kvabi serve not ready in {self.startup_timeout_s} s:\n{self.output()}")

    def stop(self) -> int | None:
        """SIGTERM (graceful), then SIGKILL after 20 s; returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def output(self, tail_chars: int = 4000) -> str:
        """The tail of the server's stdout and stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-tail_chars:]
