"""``python -m serve`` in a child process, waited for until it answers ``/health``: what tests, benchmarks and
scripts use when they need a real server (its own process and port, stopped with SIGINT like a user's Ctrl-C).

    with ServerProcess(["--model-path", path, "--no-warmup"], log_path="server.log") as server:
        httpx.post(server.base + "/generate", json=...)

Polls with the standard library only, so it needs nothing beyond the ``serve`` package itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process on ``127.0.0.1`` and a free port. ``args`` are ``python -m serve``'s flags (without
    ``--port``). Its output goes to ``log_path`` (default: a temporary file, removed by :meth:`stop` once read),
    never to a pipe nobody drains."""

    def __init__(self, args: list[str], *, env: dict | None = None, cwd: str | None = None,
                 log_path: str | None = None, startup_timeout: float = 180.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "serve", *args, "--port", str(self.port)]
        self.env, self.cwd = env, cwd
        self._temporary = log_path is None
        self.log_path = log_path or tempfile.mkstemp(prefix="dllm-serve-", suffix=".log")[1]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self._out: str | None = None

    def start(self) -> "ServerProcess":
        self.started_at = time.perf_counter()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_port(self) -> float:
        """Seconds from the process start until its port accepts connections (``/health`` may still answer 503
        ``starting`` then: the engine warms up after binding); RuntimeError as :meth:`wait_healthy`."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return time.perf_counter() - self.started_at
            except OSError:
                pass
            if time.perf_counter() - self.started_at > self.startup_timeout:
                self.stop()
                raise RuntimeError(f"server did not bind within {self.startup_timeout:.0f} s:\n{self.output()}")
            time.sleep(0.01)

    def wait_healthy(self) -> float:
        """Seconds from the process start to its first ``200`` from ``/health``; RuntimeError with the server's
        output if it exits or does not answer within ``startup_timeout``."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started_at
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() - self.started_at > self.startup_timeout:
                self.stop()
                raise RuntimeError(f"server did not answer /health within {self.startup_timeout:.0f} s:\n"
                                   f"{self.output()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGINT) -> int:
        """``sig`` (SIGINT: a clean shutdown, as a user's Ctrl-C; SIGTERM: a supervisor's), then SIGKILL after
        ``timeout``. Returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._temporary and self._out is None:
            self._out = self.output()
            os.unlink(self.log_path)
        return self.proc.returncode

    def output(self) -> str:
        """What the server printed (stdout and stderr)."""
        if self._out is not None:
            return self._out
        with open(self.log_path) as f:
            return f.read()

    def __enter__(self) -> "ServerProcess":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
