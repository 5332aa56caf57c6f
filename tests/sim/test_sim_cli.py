"""The command line: calibration, the server process (ready line, signals, port taken), fault."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from extproc.sim import cli

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--port", "1", "--fault", "explode"]) == 2
    assert cli.main(["--port"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def test_server_process_ready_line_fault_and_sigterm() -> None:
    port, admin = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "extproc.sim", "--port", str(port), "--admin-port", str(admin),
           "--time-scale", "10", "--name", "cli-sim"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"sim ready on http://127.0.0.1:{port}"), line
        status, _ = _get(f"http://127.0.0.1:{port}/health")
        assert status == 200
        # a second simulator on the same port: one clear line, exit code 2
        clash = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=30)
        assert clash.returncode == 2
        assert "already in use" in clash.stderr and "Traceback" not in clash.stderr
        assert len(clash.stderr.strip().splitlines()) == 1
        # set a fault through the admin listener
        res = subprocess.run([sys.executable, "-m", "extproc.sim", "fault", str(port), "slow", "3",
                              "--admin-port", str(admin)], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=30)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["faults"]["slow"] == 3.0
        _, state = _get(f"http://127.0.0.1:{admin}/sim/state")
        assert json.loads(state)["faults"]["slow"] == 3.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fault_cli_reports_unreachable_admin() -> None:
    port = free_port()
    t0 = time.monotonic()
    assert cli.main(["fault", str(port), "hang", "--admin-port", str(free_port())]) == 1
    assert time.monotonic() - t0 < 10


def test_speed_is_passed_to_the_simulator_and_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.build_parser().parse_args(["--port", "1", "--speed", "0.477"]).speed == 0.477
    assert cli.main(["--port", str(free_port()), "--admin-port", "-1", "--speed", "0"]) == 2
    assert "--speed must be > 0" in capsys.readouterr().err
