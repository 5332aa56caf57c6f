"""`sluice up` restarts a killed sidecar (issue #19, finding 1): Envoy keeps serving the streams in flight, new
requests get the fail-closed 503 (OpenAI-style JSON) while the sidecar is down, and service is back within 10 s
with no manual step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from extproc.config import load_policy
from extproc.supervisor import Stack

from .conftest import (assert_openai_error, assert_settled, chat, join_all, metric_sum, sim_metric, streams,
                       wait_for)
from .test_shutdown import _children, _gone, _stop_up, _write_policy

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"
BACK_WITHIN_S = 10.0


def _start_up(tmp: Path) -> tuple[subprocess.Popen, Path, Stack]:
    cfg = _write_policy(tmp)
    log = tmp / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg),
                                 "--run-dir", str(tmp / "run")],
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert wait_for(lambda: "Ctrl-C stops everything" in log.read_text() or proc.poll() is not None, 60)
    assert proc.poll() is None, log.read_text()
    return proc, log, Stack(load_policy(cfg), run_dir=tmp / "run")


def _sidecar_pid(up_pid: int) -> int:
    pids = [p for p, role in _children(up_pid).items() if role == "sidecar" and not _gone(p)]
    assert len(pids) == 1, pids
    return pids[0]


def test_sluice_up_restarts_a_killed_sidecar_under_stream_load(tmp_path: Path) -> None:
    proc, log, stack = _start_up(tmp_path)
    kids = _children(proc.pid)
    try:
        replicas = stack.policy.default_pool.replicas
        in_flight = streams(stack.base_url, 4, 300)
        assert wait_for(lambda: sum(sim_metric(a, "vllm:num_requests_running") for a in replicas) == 4, 10)
        old = _sidecar_pid(proc.pid)
        started = metric_sum(stack.metrics_url, "process_start_time_seconds")  # how operators count restarts
        t_kill = time.monotonic()
        os.kill(old, signal.SIGKILL)
        statuses: list[int] = []
        back_after = None
        with httpx.Client(base_url=stack.base_url, timeout=10) as http:
            while time.monotonic() - t_kill < BACK_WITHIN_S + 5:
                resp = http.post(CHAT, json=chat())
                statuses.append(resp.status_code)
                if resp.status_code == 200:
                    back_after = time.monotonic() - t_kill
                    break
                assert_openai_error(resp, 503)
                time.sleep(0.1)
        assert statuses[0] == 503, statuses  # while it is down: Envoy's fail-closed JSON 503
        assert back_after is not None and back_after < BACK_WITHIN_S, (back_after, statuses)
        done = join_all(in_flight)
        assert all(r[0] == 200 and r[1] >= 300 and r[2] is None for r in done), done
        new = _sidecar_pid(proc.pid)
        assert new != old and proc.poll() is None
        assert metric_sum(stack.metrics_url, "process_start_time_seconds") > started > 0
        text = log.read_text()
        assert "sidecar[0] exited (code -9); restart 1 of 5" in text and "sidecar[0] restarted" in text, text
        assert_settled(stack)
        print(f"\nsluice up: sidecar back {back_after:.2f} s after SIGKILL; {statuses.count(503)} x 503 meanwhile; "
              f"in-flight streams {[r[:3] for r in done]}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        _stop_up(proc, kids)
