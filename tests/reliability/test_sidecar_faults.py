"""The sidecar killed (SIGKILL) and restarted under traffic (issue #10, part 2).

Fail-closed (the default, `sidecar.failure_mode_allow: false`): while the sidecar is down every new request gets a
503 at once; after a restart (same argv, same ports) service is normal and governed again.
Fail-open (`failure_mode_allow: true`): while it is down requests still flow, unpinned (Envoy's least_request
fallback), ungoverned; after the restart they are pinned and governed again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import (assert_openai_error, assert_settled, chat, join_all, metric_sum, raw_http, restart_child,
                       running_stack, sim_metric, streams, wait_for)

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"


def wait_streaming(stack: Stack, n: int, timeout: float = 5) -> None:
    """Until n requests are running on the replicas (their first tokens are out)."""
    assert wait_for(lambda: sum(sim_metric(a, "vllm:num_requests_running")
                                for a in stack.policy.default_pool.replicas) >= n, timeout)


def kill_sidecar(stack: Stack) -> None:
    child = stack.child("sidecar[0]")
    assert child.proc is not None
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(5)


# ---- fail-closed (default) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("failclosed")) as s:
        yield s


def test_fail_closed_kill_gives_503_then_restart_restores_service(closed: Stack) -> None:
    http = httpx.Client(base_url=closed.base_url, timeout=10)
    assert http.post(CHAT, json=chat()).status_code == 200
    running = streams(closed.base_url, 3, max_tokens=600)
    wait_streaming(closed, 3)
    t_kill = time.monotonic()
    kill_sidecar(closed)

    # while it is down: every new request is refused at once, none reaches a replica
    served_before = sum(sim_metric(a, "vllm:request_success_total") for a in closed.policy.default_pool.replicas)
    for _ in range(10):
        t0 = time.monotonic()
        resp = http.post(CHAT, json=chat())
        assert resp.status_code == 503, resp.text
        assert time.monotonic() - t0 < 1.0
    # streams admitted before the crash end promptly (cut: see test_inflight_streams_survive_a_sidecar_crash)
    cut = join_all(running)
    for status, _events, _err, seconds in cut:
        assert seconds < 10, seconds
    print(f"\nfail-closed kill: in-flight streams {cut}, 503 body {resp.text!r} headers {dict(resp.headers)}")
    assert time.monotonic() - t_kill < 10
    # the cut reached the replicas: no ghost work left running
    assert wait_for(lambda: all(sim_metric(a, "vllm:num_requests_running") == 0
                                for a in closed.policy.default_pool.replicas), 5)
    assert sum(sim_metric(a, "vllm:request_success_total")
               for a in closed.policy.default_pool.replicas) <= served_before + 3

    ready_s = restart_child(closed.child("sidecar[0]"))
    assert ready_s < 15
    print(f"fail-closed: restarted sidecar ready in {ready_s:.2f}s")
    # normal, governed service: pinned (x-sim-replica), outcomes counted from the access log again
    for _ in range(5):
        resp = http.post(CHAT, json=chat(max_tokens=3))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-sim-replica"] in closed.policy.default_pool.replicas
    assert wait_for(lambda: metric_sum(closed.metrics_url, "sluice_requests_total", outcome="completed") >= 5, 5)
    assert_openai_error(http.post(CHAT, content=b"{bad", headers={"content-type": "application/json"}), 400,
                        "invalid_json")
    assert_settled(closed)


def test_fail_closed_503_is_openai_json_with_retry_after(closed: Stack) -> None:
    """Regression (bug 3 in docs/reliability.md): with the sidecar down Envoy answered 503 with an empty body."""
    kill_sidecar(closed)
    try:
        resp = httpx.post(closed.base_url + CHAT, json=chat(), timeout=10)
        err = assert_openai_error(resp, 503)
        assert resp.headers.get("retry-after"), dict(resp.headers)
        assert err["type"]
    finally:
        restart_child(closed.child("sidecar[0]"))


def test_inflight_streams_survive_a_sidecar_crash(closed: Stack) -> None:
    running = streams(closed.base_url, 2, max_tokens=400)
    wait_streaming(closed, 2)
    kill_sidecar(closed)
    try:
        results = join_all(running)
        assert all(r[0] == 200 and r[1] >= 400 and r[2] is None for r in results), results
    finally:
        restart_child(closed.child("sidecar[0]"))


# ---- fail-open: failure_mode_allow, with API keys on ------------------------------------------------------
@pytest.fixture(scope="module")
def open_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("failopen")
    keys = Path(tmp) / "keys.yaml"
    keys.write_text("sk-acme: acme\n")
    with running_stack(tmp, {"sidecar": {"failure_mode_allow": True},
                             "tenants": {"auth": True, "keys_file": str(keys), "keys_env": ""}}) as s:
        yield s


KEY = {"authorization": "Bearer sk-acme"}


def admitted(stack: Stack) -> float:
    return metric_sum(stack.metrics_url, "sluice_admitted_total")


def test_fail_open_kill_keeps_traffic_flowing_unpinned(open_stack: Stack) -> None:
    s = open_stack
    replicas = s.policy.default_pool.replicas
    http = httpx.Client(base_url=s.base_url, timeout=10)
    # governed: no key -> 401; with a key each request is admitted (counted) by the sidecar
    assert_openai_error(http.post(CHAT, json=chat()), 401, "invalid_api_key")
    before = admitted(s)
    for _ in range(3):
        assert http.post(CHAT, json=chat(), headers=KEY).status_code == 200
    assert admitted(s) == before + 3

    running = streams(s.base_url, 3, max_tokens=300, headers=KEY)
    wait_streaming(s, 3)
    kill_sidecar(s)
    # in-flight streams finish normally: the response path does not need the sidecar
    results = join_all(running)
    assert all(r[0] == 200 and r[1] >= 300 and r[2] is None for r in results), results
    # new requests flow, unpinned (Envoy's fallback spreads them) and ungoverned (no key needed)
    served = []
    for _ in range(12):
        resp = http.post(CHAT, json=chat())
        assert resp.status_code == 200, resp.text
        served.append(resp.headers["x-sim-replica"])
    assert len(set(served)) >= 2, served

    restart_child(s.child("sidecar[0]"))
    assert_openai_error(http.post(CHAT, json=chat()), 401, "invalid_api_key")
    for _ in range(3):
        assert http.post(CHAT, json=chat(), headers=KEY).status_code == 200
    assert admitted(s) == 3  # the new process counts from zero: every request was governed again
    assert wait_for(lambda: all(sim_metric(a, "vllm:num_requests_running") == 0 for a in replicas), 5)
    assert_settled(s)


def test_fail_open_non_utf8_header_does_not_bypass_auth(open_stack: Stack) -> None:
    """Regression (bug 2 in docs/reliability.md): with failure_mode_allow, `Authorization: Bearer \\xff` made the
    ext_proc message undecodable and Envoy let the request through ungoverned."""
    resp = raw_http(open_stack.base_url, CHAT, b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"user",'
                    b'"content":"x"}]}', [(b"content-type", b"application/json"), (b"authorization", b"Bearer \xff")])
    assert_openai_error(resp, 401, "invalid_api_key")


def test_fail_open_client_pool_header_ignored_while_sidecar_down(open_stack: Stack) -> None:
    """While the sidecar is down (failure_mode_allow), a client-sent x-sluice-pool must neither pick the Envoy
    cluster nor break the request: it is served unpinned like any other."""
    kill_sidecar(open_stack)
    try:
        resp = httpx.post(open_stack.base_url + CHAT, json=chat(), timeout=10, headers={"x-sluice-pool": "pool-x"})
        assert resp.status_code == 200, (resp.status_code, resp.text[:200])
    finally:
        restart_child(open_stack.child("sidecar[0]"))
