"""`sluice up` as a user runs it: starts everything, serves a streaming completion, stops with no orphans."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from extproc.supervisor import free_ports
from tests.tools import tool

pytestmark = pytest.mark.integration


def write_policy(tmp: Path, gw_port: int, ports: list[int]) -> Path:
    policy = {
        "gateway": {"port": gw_port, "admin_port": ports[0]},
        "sidecar": {"grpc_port": ports[1], "metrics_port": ports[2], "admin_port": ports[3]},
        "pools": [{"model": "sim-model", "replicas": [f"127.0.0.1:{p}" for p in ports[4:6]]}],
        "simulator": {"enabled": True, "preset": "tiny-cpu"},
    }
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _children(pid: int) -> list[int]:
    out = subprocess.run([tool("ps"), "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _wait_banner(proc: subprocess.Popen, timeout: float = 60) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("Ctrl-C stops everything"):
            return "".join(seen)
    raise AssertionError("no banner from sluice up:\n" + "".join(seen))


def test_up_serves_streaming_and_stops_cleanly(tmp_path: Path):
    gw, *ports = free_ports(7)
    cfg = write_policy(tmp_path, gw, ports)
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg),
                             "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        banner = _wait_banner(proc)
        assert f"http://127.0.0.1:{gw}/v1" in banner
        assert "curl" in banner and "OpenAI(" in banner
        children = _children(proc.pid)
        assert len(children) == 4  # two replicas, sidecar, envoy
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="x", max_retries=0)
        pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="sim-model", stream=True, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
            if ch.choices]
        assert len("".join(pieces)) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in children:
            assert not _alive(pid), f"child {pid} survived sluice up"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie reaped later by init still "exists"; check its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_up_with_taken_port_fails_clearly(tmp_path: Path):
    gw, *ports = free_ports(7)
    cfg = write_policy(tmp_path, gw, ports)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", gw))
        busy.listen()
        out = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg),
                              "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "already in use" in out.stderr and str(gw) in out.stderr
    assert "Traceback" not in out.stderr


def test_invalid_policy_fails_clearly(tmp_path: Path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("pools: [{model: m, replicas: [nope]}]\n")
    out = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "host:port" in out.stderr and "Traceback" not in out.stderr


def test_check_command_validates_with_envoy(tmp_path: Path):
    # from an empty directory: the built-in default policy
    out = subprocess.run([sys.executable, "-m", "extproc.cli", "check"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "envoy --mode validate: OK" in out.stdout
