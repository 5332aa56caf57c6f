"""Replica faults end to end (issue #10, part 2): a replica that hangs (clients with a deadline get a prompt
timeout) and a replica that crashes mid-stream (a prompt error, no new traffic while it is down, slow start after
it recovers). Accounting is released in the sidecar and on the replicas every time."""

from __future__ import annotations

import time
from typing import Iterator

import httpx
import pytest

from extproc.supervisor import Stack

from .conftest import (assert_openai_error, assert_settled, chat, fault, metric_sum, running_stack, sim_metric,
                       streams, wait_for)

pytestmark = [pytest.mark.reliability, pytest.mark.integration]
CHAT = "/v1/chat/completions"
# Faster health steps than production so recovery fits in a test: unreachable after 2 failed scrapes (0.4 s),
# ejected after 5, slow start 0.1 -> 0.3 -> 0.5 -> 1.0 one step per second.
OVERRIDES = {"routing": {"health": {"slow_start_step_s": 1.0}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("replicafaults"), OVERRIDES) as s:
        yield s


def replicas(stack: Stack) -> list[str]:
    return stack.policy.default_pool.replicas


def state(stack: Stack, replica: str) -> str:
    for name in ("healthy", "degraded", "ejected", "recovering"):
        if metric_sum(stack.metrics_url, "sluice_replica_state", replica=replica, state=name) == 1:
            return name
    return "?"


# ---- hang -------------------------------------------------------------------------------------------------------
def test_hung_replicas_time_out_clients_with_a_deadline_promptly(stack: Stack) -> None:
    for addr in replicas(stack):
        fault(stack, addr, "hang", True)
    try:
        timeouts_before = metric_sum(stack.metrics_url, "sluice_requests_total", outcome="timeout")
        with httpx.Client(base_url=stack.base_url, timeout=10) as http:
            # non-streaming: Envoy's upstream timeout (set by the sidecar from the deadline) -> 504 JSON
            t0 = time.monotonic()
            resp = http.post(CHAT, json=chat(max_tokens=5), headers={"x-sluice-deadline-ms": "1200"})
            elapsed = time.monotonic() - t0
            err = assert_openai_error(resp, 504)
            assert 1.0 < elapsed < 2.5, elapsed
            print(f"\nhang: non-stream {resp.status_code} {err} after {elapsed:.2f}s")
            # streaming: headers come at once (as from vLLM), then the stream is cut at the deadline
            t0 = time.monotonic()
            with http.stream("POST", CHAT, json=chat(max_tokens=5, stream=True),
                             headers={"x-sluice-deadline-ms": "1200"}) as resp:
                with pytest.raises(httpx.HTTPError):
                    for _ in resp.iter_lines():
                        pass
            assert time.monotonic() - t0 < 2.5
            # the SDK's own read timeout works the same way
            t0 = time.monotonic()
            resp = http.post(CHAT, json=chat(max_tokens=5), headers={"x-stainless-read-timeout": "1"})
            assert_openai_error(resp, 504)
            assert time.monotonic() - t0 < 2.5
        # released in the sidecar, and the hung engines dropped the abandoned requests
        assert_settled(stack)
        assert wait_for(lambda: metric_sum(stack.metrics_url, "sluice_requests_total", outcome="timeout")
                        >= timeouts_before + 3, 5)
    finally:
        for addr in replicas(stack):
            fault(stack, addr, "clear")
    out = httpx.post(stack.base_url + CHAT, json=chat(max_tokens=3), timeout=10)
    assert out.status_code == 200


# ---- crash ------------------------------------------------------------------------------------------------------
def test_replica_crash_mid_stream_then_recovery_through_slow_start(stack: Stack) -> None:
    url = stack.metrics_url
    assert wait_for(lambda: all(state(stack, a) == "healthy" for a in replicas(stack)), 10)
    running = streams(stack.base_url, 3, 1000)
    for s in running:
        assert s.started.wait(5)
    assert wait_for(lambda: all(sim_metric(a, "vllm:num_requests_running") == 1 for a in replicas(stack)), 5), \
        [s.replica for s in running]
    victim = running[0].replica
    others = [s for s in running if s.replica != victim]
    failed_before = metric_sum(url, "sluice_requests_total", outcome="failed")

    t_crash = time.monotonic()
    fault(stack, victim, "crash")
    # the client on the crashed replica gets an error promptly: a cut stream, not a hang
    status, events, error, _ = running[0].join()
    assert running[0].ended_at - t_crash < 5.0
    print(f"\ncrash: client saw {running[0].result} ended {running[0].ended_at - t_crash:.2f}s after the crash")
    assert error is not None and events < 1000, running[0].result
    # the sidecar released it, and counts it failed
    assert wait_for(lambda: metric_sum(url, "sluice_inflight_requests", replica=victim) == 0, 5)
    assert wait_for(lambda: metric_sum(url, "sluice_requests_total", outcome="failed") >= failed_before + 1, 5)
    # health: unreachable -> degraded, then ejected; new requests avoid it
    assert wait_for(lambda: state(stack, victim) == "ejected", 5), state(stack, victim)
    print(f"crash: ejected {time.monotonic() - t_crash:.2f}s after the crash")
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        served = [http.post(CHAT, json=chat(max_tokens=2)).headers.get("x-sim-replica") for _ in range(12)]
    assert victim not in served and None not in served, served

    # recovery: answers scrapes again -> RECOVERING at weight 0.1, stepping up to HEALTHY
    fault(stack, victim, "recover")
    weights: list[float] = []

    def healthy_again() -> bool:
        weights.append(metric_sum(url, "sluice_replica_weight", replica=victim))
        return state(stack, victim) == "healthy"

    assert wait_for(healthy_again, 15, 0.1), (state(stack, victim), weights)
    ramp = [w for i, w in enumerate(weights) if 0 < w < 1 and (i == 0 or w != weights[i - 1])]
    assert ramp[:1] == [0.1] and ramp == sorted(ramp) and len(ramp) >= 2, weights
    print(f"crash: recovery weights {ramp} then healthy")
    assert metric_sum(url, "sluice_replica_health_transitions_total", replica=victim, to="recovering") >= 1
    # and it takes traffic again
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        def one() -> str:
            return http.post(CHAT, json=chat(max_tokens=40, content="y " * 50)).headers["x-sim-replica"]
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(6) as pool:
            served = list(pool.map(lambda _: one(), range(12)))
    assert victim in served, served

    # the other streams were never disturbed
    for s in others:
        st_, events, error, _ = s.join()
        assert st_ == 200 and error is None and events >= 1000, s.result
    assert_settled(stack)


def test_reset_after_response_started_counts_failed() -> None:
    """Regression (bug 6 in docs/reliability.md): a stream cut by a replica crash after the response started
    (Envoy logs 200, flag UPE, upstream_reset_after_response_started{protocol_error}) was counted completed."""
    from envoy.data.accesslog.v3 import accesslog_pb2 as al

    from extproc.accesslog import FAILED, classify

    entry = al.HTTPAccessLogEntry()
    entry.response.response_code.value = 200
    entry.response.response_code_details = "upstream_reset_after_response_started{protocol_error}"
    entry.common_properties.response_flags.upstream_protocol_error = True
    entry.common_properties.upstream_cluster = "pool-sim-model"
    assert classify(entry) == FAILED
