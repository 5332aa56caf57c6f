"""Graceful shutdown (issue #10, part 3).

Sidecar: SIGTERM while requests are in flight -> they complete, new ones get 503 `draining` with retry-after, the
process exits within its grace period (10 s, `serve(grace_s=10)`).
`sluice up`: SIGTERM stops Envoy, then the sidecar, then the replicas, and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.supervisor import free_ports, http_ok
from tests.tools import tool

from .conftest import assert_openai_error, chat, join_all, metric_sum, running_stack, sim_metric, streams, wait_for

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"
GRACE_S = 10.0


def test_sigterm_drains_inflight_refuses_new_and_exits_in_grace(tmp_path: Path) -> None:
    # one slot per replica, so the 3 long streams fill the pool and 2 more wait in the sidecar's queue
    with running_stack(tmp_path, {"admission": {"max_concurrency_per_replica": 1}}) as stack:
        replicas = stack.policy.default_pool.replicas
        sidecar = stack.child("sidecar[0]")
        long_ones = streams(stack.base_url, 3, 500)
        assert wait_for(lambda: sum(sim_metric(a, "vllm:num_requests_running") for a in replicas) == 3, 5)
        waiting = streams(stack.base_url, 2, 20)
        assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_queue_depth") == 2, 5)

        t_term = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        # new requests while draining: 503 draining, retry-after, never a replica
        assert wait_for(lambda: not http_ok(sidecar.ready_url), 5)  # /ready turns 503 once it drains
        with httpx.Client(base_url=stack.base_url, timeout=10) as http:
            refused = [http.post(CHAT, json=chat()) for _ in range(3)]
        for resp in refused:
            assert_openai_error(resp, 503, "draining")
            assert int(resp.headers["retry-after"]) >= 1
            assert resp.headers.get("x-should-retry") == "true"
        running, queued = join_all(long_ones), join_all(waiting)
        # admitted work completes in full
        assert all(r[0] == 200 and r[1] >= 500 and r[2] is None for r in running), running
        # requests that were waiting in the queue are dispatched or refused cleanly, never cut
        for status, events, error, _ in queued:
            assert status == 200 and events >= 20 and error is None or status == 503, queued
        exit_code = sidecar.proc.wait(GRACE_S + 5)
        exit_s = time.monotonic() - t_term
        assert exit_code == 0
        assert exit_s < GRACE_S + 2, exit_s
        print(f"\nshutdown: running={running} queued={queued} refused={[r.status_code for r in refused]} "
              f"exit after {exit_s:.2f}s")
        assert wait_for(lambda: all(sim_metric(a, "vllm:num_requests_running") == 0 for a in replicas), 5)


# ---- sluice up -------------------------------------------------------------------------------------------------
def _write_policy(tmp: Path) -> Path:
    gw, admin, grpc, metrics, sadmin, r1, r2 = free_ports(7)
    policy = {"gateway": {"port": gw, "admin_port": admin},
              "sidecar": {"grpc_port": grpc, "metrics_port": metrics, "admin_port": sadmin},
              "pools": [{"model": "sim-model", "replicas": [f"127.0.0.1:{r1}", f"127.0.0.1:{r2}"]}],
              "simulator": {"enabled": True, "preset": "tiny-cpu"}}
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _children(pid: int) -> dict[int, str]:
    out = subprocess.run([tool("ps"), "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = {}
    for line in out.splitlines():
        p, _, args = line.strip().partition(" ")
        kids[int(p)] = "envoy" if "envoy" in args.split()[0] else "sidecar" if " serve " in args else "sim"
    return kids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _stop_up(proc: subprocess.Popen, kids: Iterable[int]) -> None:
    """A test's cleanup of `sluice up`: SIGTERM if it still runs, then SIGKILL for any child left (by PID)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    for pid in [*kids, *_children(proc.pid)]:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_sluice_up_sigterm_stops_envoy_then_sidecar_then_replicas(tmp_path: Path) -> None:
    cfg = _write_policy(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg),
                             "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("Ctrl-C stops everything"):
                break
        kids = _children(proc.pid)
        assert sorted(kids.values()) == ["envoy", "sidecar", "sim", "sim"], kids
        gone_at: dict[int, float] = {}
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while len(gone_at) < len(kids) and time.monotonic() - t0 < 30:
            for pid in kids:
                if pid not in gone_at and _gone(pid):
                    gone_at[pid] = time.monotonic() - t0
            time.sleep(0.002)  # the resolution of the exit times whose order is asserted
        assert proc.wait(30) == 0
        assert len(gone_at) == len(kids), (kids, gone_at)
        order = sorted(gone_at, key=gone_at.get)
        roles = [kids[p] for p in order]
        assert roles == ["envoy", "sidecar", "sim", "sim"], (roles, gone_at)
        print(f"\nsluice up: exited at {[(kids[p], round(gone_at[p], 3)) for p in order]} s after SIGTERM")
        # no orphans: nothing left in the process group / session either
        left = subprocess.run([tool("ps"), "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True).stdout
        assert not [p for p in left.split() if int(p) != proc.pid and not _gone(int(p))], left
        for pid in kids:
            assert _gone(pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
