"""deploy/alerts.yml: valid for promtool, its unit tests pass, and it only uses metrics the project exports."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.tools import tool

from .promql import ALERTS, DEPLOY, ENVOY_METRICS, alert_exprs, exported_metric_names, metric_names

REQUIRED = {  # what the alerts must cover -> the alert that does
    "replica degraded": "SluiceReplicaDegraded",
    "queue saturated": "SluiceQueueSaturated",
    "shed rate high": "SluiceShedRateHigh",
    "retry budget exhausted": "SluiceRetryBudgetExhausted",
    "prompt-cost shift": "SluicePromptCostShift",
    "Redis fallback active": "SluiceRedisFallback",
    "connection limit near": "SluiceConnectionLimitNear",
}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY)


def test_promtool_check_rules():
    proc = run("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_pass():
    proc = run("test", "rules", "alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_can_fail(tmp_path):
    """The unit tests are not vacuous: a broken threshold makes them fail."""
    broken = ALERTS.read_text().replace("> 0.05", "> 0.5")
    assert broken != ALERTS.read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path / "alerts_test.yml")
    proc = subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "SluiceShedRateHigh" in proc.stdout + proc.stderr


def test_required_alerts_exist_and_are_tested():
    exprs = alert_exprs()
    tests = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())
    firing = {case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", [])
              if case.get("exp_alerts")}
    for what, name in REQUIRED.items():
        assert name in exprs, f"no alert for {what}"
    untested = sorted(set(exprs) - firing)
    assert not untested, f"alerts without a firing unit test: {untested}"


def test_alerts_use_only_exported_metrics():
    exported = exported_metric_names()
    unknown = {name: sorted(metric_names(expr) - exported) for name, expr in alert_exprs().items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"alert expressions name metrics nobody exports: {unknown}"
    used = set().union(*(metric_names(e) for e in alert_exprs().values()))
    assert {"sluice_replica_state", "sluice_shed_total", "sluice_budget_store_fallback_active",
            "envoy_http_downstream_cx_active"} <= used


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (pool, le) (rate(sluice_queue_wait_seconds_bucket{pool=~"$pool",'
            'lane!="x"}[5m]))) > 5 and on (pool) sum by (pool) (sluice_queue_depth offset 1m) > 0 '
            'or vector(1) unless up{job="a"} / scalar(max(vllm:num_requests_waiting)) * 1e3')
    assert metric_names(expr) == {"sluice_queue_wait_seconds_bucket", "sluice_queue_depth", "up",
                                  "vllm:num_requests_waiting"}
    assert metric_names("label_values(sluice_inflight_requests, pool)") == {"sluice_inflight_requests"}
    assert metric_names(f"rate(envoy_cluster_upstream_rq_retry[$__rate_interval])") == {
        "envoy_cluster_upstream_rq_retry"}


def test_exported_names_include_every_package():
    names = exported_metric_names()
    for expected in ("sluice_requests_total", "sluice_queue_wait_seconds_bucket", "sluice_shed_total",
                     "sluice_budget_store_fallback_active", "sluice_replica_kv_usage", "sluice_policy_reloads_total",
                     "sluice_replica_draining", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                     "sglang:num_queue_reqs"):
        assert expected in names, expected
    assert "sluice_not_a_metric" not in names
    assert all(n.startswith("envoy_") for n in ENVOY_METRICS)
