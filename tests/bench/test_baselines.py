"""The baseline gateways: envoy-tuned renders what its docstrings say and the real Envoy accepts it; smg's
command line is the shipped defaults plus cache_aware."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.baselines import BaselineOptions, smg_argv
from extproc.config import policy_from_dict
from extproc.cli import validate_with_envoy
from extproc.xds import render

POLICY = {"pools": [{"model": "m", "replicas": ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]}],
          "gateway": {"max_downstream_connections": 800, "socket_send_buffer_bytes": 16384}}
TENANTS = BaselineOptions(max_num_seqs=128, tenant_rps={"steady": 12.9, "flood": 12.9})


def _resources(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text())["resources"]


@pytest.mark.parametrize("options", [BaselineOptions(), TENANTS], ids=["no-tenants", "tenants"])
def test_envoy_validates_envoy_tuned(options: BaselineOptions):
    ok, out = validate_with_envoy(policy_from_dict(POLICY), "envoy-tuned", baseline=options)
    assert ok, out


def test_envoy_tuned_has_the_operators_choices(tmp_path: Path):
    policy = policy_from_dict(POLICY)
    tuned = render(policy, tmp_path / "tuned", "envoy-tuned", baseline=TENANTS)
    rr = render(policy, tmp_path / "rr", "envoy-rr")
    (cluster,) = _resources(tuned["cds"])
    assert "least_request" in cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
    slow = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert slow["slow_start_config"]["slow_start_window"] == "10s"
    th = cluster["circuit_breakers"]["thresholds"][0]
    assert th["max_requests"] == th["max_connections"] == th["max_pending_requests"] == 3 * 128
    assert th["retry_budget"]["budget_percent"]["value"] == 20.0
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert cluster["health_checks"][0]["no_traffic_interval"] == cluster["health_checks"][0]["interval"] == "1s"
    assert cluster["outlier_detection"]["consecutive_5xx"] == 5
    assert cluster["outlier_detection"]["consecutive_gateway_failure"] == 3
    (listener,) = _resources(tuned["lds"])
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.local_ratelimit", "envoy.filters.http.admission_control", "envoy.filters.http.router"]
    descriptors = hcm["http_filters"][0]["typed_config"]["descriptors"]
    assert {d["entries"][0]["value"]: d["token_bucket"]["max_tokens"] for d in descriptors} == \
        {"steady": 13, "flood": 13}
    (route,) = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    retry = route["route"]["retry_policy"]
    assert retry["retry_on"] == "reset,connect-failure,retriable-status-codes"
    assert retry["retriable_status_codes"] == [503] and retry["per_try_idle_timeout"] == "30s"
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert route["route"]["rate_limits"][0]["actions"][0]["request_headers"]["header_name"] == "x-sluice-tenant"
    # the environment is envoy-rr's: listener buffers, socket options, the connection limit
    (rr_listener,) = _resources(rr["lds"])
    for key in ("per_connection_buffer_limit_bytes", "socket_options", "address"):
        assert listener[key] == rr_listener[key]
    assert yaml.safe_load(tuned["bootstrap"].read_text())["overload_manager"] == \
        yaml.safe_load(rr["bootstrap"].read_text())["overload_manager"]


def test_envoy_rr_keeps_envoys_default_circuit_breakers(tmp_path: Path):
    """The naive baseline gets what Envoy ships (1,024 per priority), not ceilings raised to a million."""
    (cluster,) = _resources(render(policy_from_dict(POLICY), tmp_path, "envoy-rr")["cds"])
    assert "circuit_breakers" not in cluster
    assert "health_checks" not in cluster and "outlier_detection" not in cluster


def test_smg_runs_its_shipped_defaults_with_cache_aware():
    argv = smg_argv(policy_from_dict(POLICY))
    assert argv[1] == "launch" and argv[argv.index("--policy") + 1] == "cache_aware"
    urls = argv[argv.index("--worker-urls") + 1:argv.index("--policy")]
    assert urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]
    assert argv[argv.index("--worker-startup-check-interval") + 1] == "1"   # start-up polling only
    assert argv[argv.index("--shutdown-grace-period-secs") + 1] == "1"      # teardown only
    tuning = [a for a in argv if a.startswith("--retry") or a.startswith("--cb-") or a.startswith("--health")
              or a.startswith("--max-concurrent") or a.startswith("--worker-overload") or a == "--disable-retries"]
    assert tuning == []
