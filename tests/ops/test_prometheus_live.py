"""A real Prometheus (the Debian package's binary) scrapes a running stack (Envoy, sidecar, simulated replicas)
with deploy/prometheus.yml's jobs (targets rewritten to the stack's ports) and deploy/alerts.yml's rules; PromQL
over its HTTP API returns the expected series, and every rule evaluates without error."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from extproc.config import policy_from_dict
from extproc.supervisor import Stack, free_ports, http_ok, with_free_ports
from tests.tools import tool
from tests.waiting import wait_for

from .promql import ALERTS, DEPLOY, ENVOY_METRICS, alert_exprs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REQUESTS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    policy = with_free_ports(policy_from_dict({
        "pools": [{"model": "sim-model", "replicas": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}],
        "simulator": {"enabled": True, "preset": "tiny-cpu", "time_scale": 5.0},
    }))
    s = Stack(policy, run_dir=tmp_path_factory.mktemp("stack"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def prometheus_config(stack: Stack) -> dict:
    """deploy/prometheus.yml with the compose targets replaced by the stack's, scraping every second."""
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ALERTS)]
    gw, sc = stack.policy.gateway, stack.policy.sidecar
    targets = {
        "envoy": [f"{gw.admin_host}:{gw.admin_port}"],
        "sluice": [f"{sc.metrics_host}:{sc.metrics_port}"],
        "replicas": [addr for _model, addr in stack.simulated_replicas()],
    }
    assert {j["job_name"] for j in cfg["scrape_configs"]} == set(targets)
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return cfg


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    prometheus_bin = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(stack)))
    port = free_ports(1)[0]
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus_bin, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or http_ok(f"{url}/-/ready"), 20, 0.1)
        if proc.poll() is not None or not http_ok(f"{url}/-/ready"):
            pytest.fail("prometheus did not start:\n" + (tmp / "prometheus.log").read_text()[-2000:])
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def api(base: str, path: str, **params: str) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{base}/api/v1/{path}{query}", timeout=5) as resp:
        data = json.loads(resp.read())
    assert data["status"] == "success", data
    return data["data"]


def value(base: str, expr: str) -> float | None:
    result = api(base, "query", query=expr)["result"]
    return float(result[0]["value"][1]) if result else None


def wait_value(base: str, expr: str, pred, timeout: float = 15.0) -> float | None:
    """The query's value once `pred` holds for it, else its last value at the deadline."""
    last: list[float | None] = [None]

    def holds() -> bool:
        last[0] = value(base, expr)
        return last[0] is not None and pred(last[0])

    wait_for(holds, timeout, 0.25)
    return last[0]


def send_requests(stack: Stack, n: int) -> None:
    body = json.dumps({"model": "sim-model", "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    for _ in range(n):
        req = urllib.request.Request(f"{stack.base_url}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200


def test_prometheus_scrapes_the_stack(stack: Stack, prometheus: str):
    send_requests(stack, REQUESTS)
    # every target up
    assert wait_value(prometheus, 'count(up{job="replicas"} == 1)', lambda v: v == 3) == 3
    assert wait_value(prometheus, 'up{job="sluice"}', lambda v: v == 1) == 1
    assert wait_value(prometheus, 'up{job="envoy"}', lambda v: v == 1) == 1
    # Envoy's own stats
    assert wait_value(prometheus, 'sum(envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="ingress"})',
                      lambda v: v >= REQUESTS) >= REQUESTS
    assert wait_value(prometheus, 'sum(envoy_cluster_upstream_rq_total{envoy_cluster_name="pool-sim-model"})',
                      lambda v: v >= REQUESTS) >= REQUESTS
    assert wait_value(prometheus, "sum(envoy_http_ext_proc_sluice_streams_started)",
                      lambda v: v >= REQUESTS) >= REQUESTS
    # the sidecar's
    assert wait_value(prometheus, 'sum(sluice_admitted_total{pool="sim-model"})',
                      lambda v: v >= REQUESTS) >= REQUESTS
    assert wait_value(prometheus, 'sum(sluice_requests_total{pool="sim-model",outcome="completed"})',
                      lambda v: v >= REQUESTS) >= REQUESTS
    # the replicas' (vLLM names)
    assert wait_value(prometheus, 'count(vllm:kv_cache_usage_perc{job="replicas"})', lambda v: v == 3) == 3
    assert wait_value(prometheus, 'sum(vllm:request_success_total{job="replicas"})',
                      lambda v: v >= REQUESTS) >= REQUESTS


def test_alert_rules_load_and_evaluate(stack: Stack, prometheus: str):
    expected = set(alert_exprs())
    rules: dict = {}

    def all_evaluated() -> bool:
        groups = api(prometheus, "rules")["groups"]
        rules.clear()
        rules.update({r["name"]: r for g in groups for r in g["rules"]})
        return set(rules) == expected and all(r.get("lastEvaluation", "").startswith("20") for r in rules.values())

    wait_for(all_evaluated, 15, 0.25)
    assert set(rules) == expected
    bad = {name: r.get("lastError") for name, r in rules.items() if r["health"] != "ok"}
    assert not bad, f"rules failing to evaluate: {bad}"
    # a healthy stack fires nothing but possibly info-level ones
    firing = [a for a in api(prometheus, "alerts")["alerts"] if a["state"] == "firing"]
    assert not [a for a in firing if a["labels"].get("severity") == "critical"], firing


def test_envoy_metric_names_used_by_deploy_exist(stack: Stack):
    """Every Envoy stat the alerts and the dashboard use is exported by this Envoy with the rendered config."""
    send_requests(stack, 1)
    with urllib.request.urlopen(f"{stack.admin_url}/stats/prometheus", timeout=5) as resp:
        text = resp.read().decode()
    names = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}
    missing = sorted(ENVOY_METRICS - names)
    assert not missing, f"Envoy does not export {missing}"
