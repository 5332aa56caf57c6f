"""`sluice up` recycles a sidecar worker whose memory grew past `sidecar.recycle_rss_mb` (issue #19, finding 8):
a replacement shares the gRPC port, serves, and the old worker hands over (listener closed, GOAWAY) and exits; no
request is lost. The worker's RSS is pushed over a low limit by clients that abandon requests after their headers
(each held ext_proc stream costs the worker memory it keeps), as bench/abort_soak.py does."""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml

from extproc.config import load_policy
from extproc.restarts import read_rss_mb
from extproc.supervisor import Stack, free_ports

from .conftest import accounting, join_all, metric_sum, sim_metric, streams, wait_for
from .test_shutdown import _children, _gone, _stop_up

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
# A worker holds about 90-95 MB at rest here; holding 1,000 abandoned requests at once took one from 93 to 117 MB, and
# holding the same number again added nothing (the allocator reuses what the first batch freed), so each batch holds
# more requests than the last: the replacement starts under the limit, the old worker passes it.
LIMIT_MB = 110
CHECK_S = 0.5
HELD = (1000, 1500, 2000, 3000)
# The streams in flight at the handover: about 25 s each. On the h2 server (extproc/h2grpc.py, the default) a held
# stream costs the worker less memory than on grpc.aio, so the limit is passed a batch or two later (at 2,000 tokens,
# ~8.6 s, the streams had ended before the handover).
TOKENS = 6000


def _policy(tmp: Path) -> Path:
    gw, admin, grpc, metrics, sadmin, r1, r2 = free_ports(7)
    policy = {"gateway": {"port": gw, "admin_port": admin},
              "sidecar": {"grpc_port": grpc, "metrics_port": metrics, "admin_port": sadmin,
                          "recycle_rss_mb": LIMIT_MB, "recycle_check_s": CHECK_S},
              "pools": [{"model": "sim-model", "replicas": [f"127.0.0.1:{r1}", f"127.0.0.1:{r2}"]}],
              "simulator": {"enabled": True, "preset": "tiny-cpu"}}
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _sidecars(up_pid: int) -> list[int]:
    return [p for p, role in _children(up_pid).items() if role == "sidecar" and not _gone(p)]


def _hold_until(host: str, port: int, n: int, metrics_url: str, until: Callable[[], bool], timeout_s: float) -> bool:
    """`n` HTTP/1 requests that send their headers and are held by the sidecar until `until()` (at most
    `timeout_s`), then abandoned; returns `until()`."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: 96\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(head)
            socks.append(s)
        wait_for(lambda: metric_sum(metrics_url, "sluice_open_streams") >= n, 10)
        return wait_for(until, timeout_s)
    finally:
        for s in socks:
            s.close()


def _open_streams(metrics_url: str) -> float:
    """The serving worker's open ext_proc streams; infinite while its metrics port is between two workers."""
    try:
        return metric_sum(metrics_url, "sluice_open_streams")
    except OSError:
        return float("inf")


class SteadyClient:
    """One openai SDK client sending short chat completions back to back (no SDK retries: every attempt counts)."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=10)
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.client.chat.completions.create(model="sim-model", max_tokens=2,
                                                    messages=[{"role": "user", "content": "x"}])
                self.outcomes.append("200")
            except openai.APIStatusError as exc:
                self.outcomes.append(f"{exc.status_code} {exc.body} at {time.time():.3f}")
            except openai.APIError as exc:
                self.outcomes.append(f"{type(exc).__name__} at {time.time():.3f}")
            time.sleep(0.01)

    def finish(self) -> list[str]:
        self.stop.set()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the steady client hung"
        return self.outcomes


def test_sluice_up_recycles_a_grown_worker_without_losing_a_request(tmp_path: Path) -> None:
    cfg = _policy(tmp_path)
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "up", "--config", str(cfg),
                                 "--run-dir", str(tmp_path / "run")],
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    kids: list[int] = []
    try:
        assert wait_for(lambda: "Ctrl-C stops everything" in log.read_text() or proc.poll() is not None, 60)
        assert proc.poll() is None, log.read_text()
        kids = list(_children(proc.pid))
        stack = Stack(load_policy(cfg), run_dir=tmp_path / "run")
        replicas = stack.policy.default_pool.replicas
        gw = stack.policy.gateway
        [old] = _sidecars(proc.pid)
        rest_mb = read_rss_mb(old)
        assert rest_mb is not None and rest_mb < LIMIT_MB, (rest_mb, LIMIT_MB)
        old_start = metric_sum(stack.metrics_url, "process_start_time_seconds")
        in_flight = streams(stack.base_url, 4, TOKENS)
        assert wait_for(lambda: sum(sim_metric(a, "vllm:num_requests_running") for a in replicas) >= 4, 10)
        batches = 0
        starting = False
        while not starting and batches < len(HELD):
            starting = _hold_until(gw.host, gw.port, HELD[batches], stack.metrics_url,
                                   lambda: "starting its replacement" in log.read_text(), 2 * CHECK_S + 1)
            batches += 1
        assert starting, (batches, read_rss_mb(old), log.read_text()[-3000:])
        # The steady client starts once the abandoned requests are gone (what thousands of clients leaving at once
        # cost is not what this test is about) and before the old worker hands over: its replacement takes a
        # second or more to start.
        assert wait_for(lambda: _open_streams(stack.metrics_url) <= 4 or "recycled at RSS" in log.read_text(), 10)
        steady = SteadyClient(stack.base_url)
        assert "recycled at RSS" not in log.read_text(), "handed over before the steady client started"
        assert wait_for(lambda: "recycled at RSS" in log.read_text(), 60), log.read_text()[-3000:]
        running_at_handover = sum(sim_metric(a, "vllm:num_requests_running") for a in replicas)
        text = log.read_text()
        assert "recycled at RSS" in text, (batches, read_rss_mb(old), text[-3000:])
        assert wait_for(lambda: "after handing over" in log.read_text(), 15), log.read_text()[-3000:]
        time.sleep(1.0)  # the steady client goes on through the replacement alone
        outcomes = steady.finish()
        done = join_all(in_flight)
        [new] = _sidecars(proc.pid)
        new_mb = read_rss_mb(new)
        # every attempt of the steady client succeeded, before, during and after the handover
        if not all(o == "200" for o in outcomes):
            print("\nfailed attempts:", [o for o in outcomes if o != "200"],
                  [ln for ln in log.read_text().splitlines() if ln.startswith("sluice up:")])
        assert outcomes and all(o == "200" for o in outcomes), (
            collections.Counter(o[:40] for o in outcomes), [o for o in outcomes if o != "200"],
            [ln for ln in log.read_text().splitlines() if ln.startswith("sluice up:")])
        # streams in flight at the handover (already detached by the old worker) complete
        assert running_at_handover >= 4 and all(r[0] == 200 and r[1] >= TOKENS and r[2] is None for r in done), \
            (running_at_handover, done)
        assert new != old and _gone(old)
        # the supervisor's check does not fire again: the replacement is under the limit for several checks
        time.sleep(4 * CHECK_S)
        text = log.read_text()
        assert text.count("recycled at RSS") == 1 and "restart" not in text, text[-3000:]
        assert new_mb is not None and new_mb < LIMIT_MB
        left = re.search(r"left ([0-9.]+) s after handing over \(exit code (-?\d+)\)", text)
        assert left and left.group(2) == "0", text[-3000:]
        # the replacement took over the metrics and admin ports, and settles what it admitted
        assert wait_for(lambda: metric_sum(stack.metrics_url, "process_start_time_seconds") > old_start > 0, 10)
        with socket.create_connection(("127.0.0.1", stack.policy.sidecar.admin_port), timeout=2):
            pass
        assert wait_for(lambda: not any(accounting(stack).values()), 5), accounting(stack)
        print(f"\nrecycle: {len(outcomes)} steady requests all 200; held aborts {HELD[:batches]}; "
              f"pid {old} ({rest_mb:.1f} MB at rest) -> {new} ({new_mb:.1f} MB); "
              f"streams {[(r[0], r[1], round(r[3], 1)) for r in done]} "
              f"({running_at_handover:g} running at the handover); "
              f"{[ln for ln in text.splitlines() if ln.startswith('sluice up:')]}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        _stop_up(proc, kids)
