"""A real redis-server as a child process on a free loopback port: started, killed by PID, restarted on the same
port. The benchmarks that need Redis (bench/budget_store_cost.py) and the tests' fixtures (tests/budgets/
conftest.py, which fail a test naming the package to install) start it the same way."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

START_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    """One redis-server, no persistence (`--save "" --appendonly no`); start / kill / restart on the same port."""

    def __init__(self, port: int | None = None, exe: str | None = None) -> None:
        self.port = port or free_port()
        self.exe = exe  # None: redis-server on PATH
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = self.exe or shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y --no-install-recommends redis-server")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers_ping():
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S:g} s")
            time.sleep(0.02)

    def _answers_ping(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.proc = None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
