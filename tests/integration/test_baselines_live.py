"""The benchmark's baselines are live, not only rendered: envoy-tuned's health checks, outlier detection,
retries, admission_control and per-tenant local_ratelimit act on real traffic through the real Envoy, and smg
registers, health-checks and scrapes the simulated replicas."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from extproc.baselines import BaselineOptions
from extproc.config import policy_from_dict
from extproc.supervisor import Stack, with_free_ports

from .conftest import BASE_POLICY, wait_for

pytestmark = pytest.mark.integration

BODY = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}],
                   "max_tokens": 4}).encode()


def _post(stack: Stack, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(stack.base_url + "/v1/chat/completions", data=BODY, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        err.read()
        return err.code, dict(err.headers)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _stat(stack: Stack, name: str) -> float:
    for line in _get(stack.admin_url + "/stats?filter=" + name).splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return float(value)
    return 0.0


def _failed_hc(stack: Stack, addr: str) -> bool | None:
    """Envoy's view of one host (admin /clusters, JSON): True when active health checking has failed it."""
    port = int(addr.rsplit(":", 1)[1])
    for cluster in json.loads(_get(stack.admin_url + "/clusters?format=json"))["cluster_statuses"]:
        for host in cluster.get("host_statuses", []):
            if host["address"]["socket_address"].get("port_value") == port:
                return bool(host.get("health_status", {}).get("failed_active_health_check"))
    return None


def _fault(stack: Stack, index: int, fault: str, value: object = None) -> None:
    addr = stack.policy.pools[0].replicas[index]
    payload = {"fault": fault} if value is None else {"fault": fault, "value": value}
    req = urllib.request.Request(stack.sim_admin_url(addr) + "/sim/fault", data=json.dumps(payload).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    policy = with_free_ports(policy_from_dict(BASE_POLICY))
    stack = Stack(policy, run_dir=tmp_path_factory.mktemp("tuned"), mode="envoy-tuned",
                  baseline=BaselineOptions(max_num_seqs=64, tenant_rps={"limited": 2.0}))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_active_health_checks_take_a_crashed_replica_out_and_retries_hide_it(tuned: Stack):
    host = tuned.policy.pools[0].replicas[0]
    assert wait_for(lambda: _failed_hc(tuned, host) is False, 10)
    _fault(tuned, 0, "crash")
    try:
        # every request succeeds while the replica is down: connect failures are retried on another host
        statuses = [_post(tuned)[0] for _ in range(12)]
        assert statuses == [200] * 12
        assert wait_for(lambda: _failed_hc(tuned, host) is True, 10)
        assert _stat(tuned, "cluster.pool-sim-model.health_check.failure") > 0
    finally:
        _fault(tuned, 0, "recover")
    assert wait_for(lambda: _failed_hc(tuned, host) is False, 10)


def test_outlier_detection_ejects_a_replica_that_fails_and_admission_control_counts(tuned: Stack):
    _fault(tuned, 1, "error-rate", 1.0)
    try:
        statuses = [_post(tuned)[0] for _ in range(30)]
        assert 500 in statuses
        assert wait_for(lambda: _stat(tuned, "cluster.pool-sim-model.outlier_detection.ejections_enforced_total")
                        >= 1, 5)
    finally:
        _fault(tuned, 1, "clear")
    assert _stat(tuned, "http.ingress.admission_control.rq_failure") >= 1
    assert _stat(tuned, "http.ingress.admission_control.rq_success") >= 1


def test_local_ratelimit_limits_a_tenant_with_a_retry_after(tuned: Stack):
    limited = [_post(tuned, {"x-sluice-tenant": "limited"}) for _ in range(8)]
    assert any(status == 429 and headers.get("retry-after") == "1" for status, headers in limited)
    assert _stat(tuned, "tenant_rate_limit.http_local_rate_limit.rate_limited") >= 1
    # only the named tenant is limited (admission_control may still refuse some with 503 after the error test)
    other = [_post(tuned, {"x-sluice-tenant": "other"})[0] for _ in range(8)]
    assert 429 not in other and 200 in other


def _hold(addr: str) -> None:
    """A request sent straight to a (hung) replica, so its own /metrics shows it queued."""
    req = urllib.request.Request(f"http://{addr}/v1/chat/completions", data=BODY, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=20).read()
    except OSError:
        pass


def test_smg_registers_health_checks_and_scrapes_the_simulated_replicas(tmp_path: Path):
    policy = with_free_ports(policy_from_dict(BASE_POLICY))
    stack = Stack(policy, run_dir=tmp_path, mode="smg")
    stack.start()
    replicas = policy.pools[0].replicas
    try:
        def registered() -> list[dict]:  # smg registers its workers in the background after it starts serving
            workers = json.loads(_get(stack.base_url + "/workers"))["workers"]
            return workers if len(workers) == len(replicas) and all(w["is_healthy"] for w in workers) else []

        workers = wait_for(registered, 15) or json.loads(_get(stack.base_url + "/workers"))["workers"]
        assert sorted(w["url"] for w in workers) == sorted(f"http://{a}" for a in replicas)
        assert all(w["is_healthy"] and w["runtime_type"] == "vllm" for w in workers)
        assert _post(stack)[0] == 200
        assert "smg_router_requests_total" in _get(stack.admin_url + "/metrics")
        # smg's load monitor scrapes each replica's /metrics (every 10 s by default): a hung replica's queue shows
        _fault(stack, 0, "hang")
        threads = [threading.Thread(target=_hold, args=(replicas[0],), daemon=True) for _ in range(2)]
        for t in threads:
            t.start()

        def queued() -> bool:
            loads = json.loads(_get(stack.base_url + "/get_loads"))["loads"]
            return any(x["worker"] == f"http://{replicas[0]}" and x["num_running_reqs"] + x["num_waiting_reqs"] > 0
                       for x in loads)
        assert wait_for(queued, 15, 0.5)
    finally:
        _fault(stack, 0, "clear")
        stack.stop()
