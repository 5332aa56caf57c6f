"""End to end against a real stack (Envoy + `sluice serve` + simulated replicas): the `sluice` commands reach the
sidecar's admin API, a drained replica gets no new requests, undrain goes through slow start, and the policy file
reloads on change and on SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "sim-model"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    policy = with_free_ports(policy_from_dict({
        "pools": [{"model": MODEL, "replicas": ["127.0.0.1:1", "127.0.0.1:2"]}],
        "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 5.0},
    }))
    s = Stack(policy, run_dir=tmp_path_factory.mktemp("ops-stack"))
    s.start()
    try:
        port = policy.sidecar.admin_port
        assert wait_for(lambda: listening(port), 5, 0.1), \
            f"`sluice serve` did not open its admin API on 127.0.0.1:{port}:\n{s.child('sidecar[0]').log_tail()}"
        yield s
    finally:
        s.stop()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def sluice(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "extproc.cli", *args, "--config", str(stack.run_dir / "policy.yaml")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def status(stack: Stack) -> dict:
    proc = sluice(stack, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["sidecars"][0]["status"]


def replicas(stack: Stack) -> dict[str, dict]:
    return {r["address"]: r for r in status(stack)["pools"][0]["replicas"]}


def chat(stack: Stack) -> str:
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{stack.base_url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers.get("x-sim-replica", "")


def test_status_drain_undrain(stack: Stack):
    addrs = [a for _m, a in stack.simulated_replicas()]
    wait_for(lambda: all(r["scrape_age_s"] >= 0 for r in replicas(stack).values()), 10, 0.2)  # every replica read
    reps = replicas(stack)
    assert set(reps) == set(addrs) and all(r["state"] == "healthy" for r in reps.values())

    drained = addrs[0]
    proc = sluice(stack, "drain", drained)
    assert proc.returncode == 0 and "drained" in proc.stdout, proc.stderr
    served = {chat(stack) for _ in range(6)}
    assert drained not in served and served == {addrs[1]}
    assert replicas(stack)[drained]["draining"] is True

    proc = sluice(stack, "undrain", drained)
    assert proc.returncode == 0 and "recovering" in proc.stdout, proc.stdout + proc.stderr
    r = replicas(stack)[drained]
    assert r["draining"] is False and r["state"] == "recovering" and r["weight"] < 1.0

    top = sluice(stack, "top", "--once")
    assert top.returncode == 0 and drained in top.stdout and "recovering" in top.stdout


def test_reload_on_file_change_and_sighup(stack: Stack):
    path = stack.run_dir / "policy.yaml"
    original = path.read_text()
    data = yaml.safe_load(original)
    try:
        data["admission"] = {"kv_margin": 5}  # invalid
        path.write_text(yaml.safe_dump(data))
        proc = sluice(stack, "reload")
        assert proc.returncode == 1 and "kv_margin" in proc.stderr
        data["admission"] = {"kv_margin": 0.2}
        path.write_text(yaml.safe_dump(data))
        last: dict = {}

        def reloaded_from_file() -> bool:  # the watcher polls the file every second
            last.clear()
            last.update(status(stack).get("last_reload") or {})
            return bool(last.get("ok")) and last.get("trigger") == "file_change"

        wait_for(reloaded_from_file, 10, 0.2)
        assert last.get("ok") and last.get("trigger") == "file_change", last
        sidecar = stack.child("sidecar[0]")
        os.kill(sidecar.proc.pid, signal.SIGHUP)
        wait_for(lambda: (status(stack).get("last_reload") or {}).get("trigger") == "sighup", 5, 0.1)
        assert status(stack)["last_reload"]["trigger"] == "sighup"
        assert sidecar.alive()
    finally:
        path.write_text(original)
    metrics = urllib.request.urlopen(stack.metrics_url, timeout=5).read().decode()
    assert 'sluice_policy_reloads_total{result="error"}' in metrics
